//! NVMe/TCP framing for the runtime spike, sans-IO.
//!
//! Hot path. Just enough of the PDU formats (ICReq/ICResp, CapsuleCmd with a Read SQE, C2HData,
//! CapsuleResp with a CQE) that the per-I/O costs match a real target: the same byte counts on
//! the wire and one 4 KiB memcpy per read. Both servers and the client call the functions here,
//! so neither runtime gets a better batching strategy than the other: the runtimes differ only
//! in how bytes get in and out of the socket.

use std::fmt;

pub const PDU_TYPE_IC_REQ: u8 = 0x00;
pub const PDU_TYPE_IC_RESP: u8 = 0x01;
pub const PDU_TYPE_CAPSULE_CMD: u8 = 0x04;
pub const PDU_TYPE_CAPSULE_RESP: u8 = 0x05;
pub const PDU_TYPE_C2H_DATA: u8 = 0x07;

/// C2HData flag: the last PDU of this command's data transfer.
pub const C2H_FLAG_LAST_PDU: u8 = 0x04;
pub const OPCODE_READ: u8 = 0x02;
/// The only namespace the spike serves.
pub const NAMESPACE_ID: u32 = 1;

pub const COMMON_HEADER_BYTES: usize = 8;
pub const IC_PDU_BYTES: usize = 128;
pub const SQE_BYTES: usize = 64;
pub const CQE_BYTES: usize = 16;
pub const CAPSULE_CMD_BYTES: usize = COMMON_HEADER_BYTES + SQE_BYTES;
pub const CAPSULE_RESP_BYTES: usize = COMMON_HEADER_BYTES + CQE_BYTES;
pub const C2H_HEADER_BYTES: usize = 24;
pub const BLOCK_BYTES: usize = 4096;
pub const C2H_PDU_BYTES: usize = C2H_HEADER_BYTES + BLOCK_BYTES;
/// Bytes the target sends for one 4 KiB read: C2HData header and data, then CapsuleResp.
pub const RESPONSE_BYTES_PER_READ: usize = C2H_PDU_BYTES + CAPSULE_RESP_BYTES;
/// The largest PDU either side accepts; anything larger is a protocol error, never a wait.
pub const PDU_BYTES_MAX: usize = C2H_PDU_BYTES;

/// The in-RAM "namespace" the target reads from.
pub const STORE_BYTES: usize = 64 << 20;
pub const STORE_BLOCKS: u64 = (STORE_BYTES / BLOCK_BYTES) as u64;
/// Submission queue size the target reports head positions against.
pub const SUBMISSION_QUEUE_ENTRIES: u16 = 128;

/// Commands the target turns into responses before it writes them out; bounds the output buffer.
pub const BATCH_COMMANDS_MAX: usize = 128;
/// Read buffer of a target connection: many commands per read syscall.
pub const SERVER_INPUT_BUFFER_BYTES: usize = 64 << 10;
/// Output buffer of a target connection: the ICResp and one full batch.
pub const SERVER_OUTPUT_BUFFER_BYTES: usize =
    IC_PDU_BYTES + BATCH_COMMANDS_MAX * RESPONSE_BYTES_PER_READ;

const _: () = assert!(STORE_BYTES.is_multiple_of(BLOCK_BYTES));
const _: () = assert!(SERVER_INPUT_BUFFER_BYTES >= 2 * PDU_BYTES_MAX);
const _: () = assert!(SUBMISSION_QUEUE_ENTRIES as usize >= BATCH_COMMANDS_MAX);

#[derive(Debug, PartialEq, Eq)]
pub enum ProtocolError {
    PduUnexpected { pdu_type: u8 },
    PduLengthInvalid { pdu_type: u8, header_bytes: u8, pdu_bytes: u32 },
    OpcodeUnsupported { opcode: u8 },
    NamespaceUnknown { namespace_id: u32 },
    TransferLengthUnsupported { blocks_zero_based: u16 },
    CommandIdUnexpected { command_id: u16 },
    CompletionStatusError { command_id: u16, status: u16 },
    DataMismatch { command_id: u16, lba: u64 },
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NVMe/TCP protocol error: {self:?}")
    }
}

impl std::error::Error for ProtocolError {}

fn u16_at(bytes: &[u8], offset: usize) -> u16 {
    u16::from_le_bytes([bytes[offset], bytes[offset + 1]])
}

fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[offset..offset + 4]);
    u32::from_le_bytes(word)
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[offset..offset + 8]);
    u64::from_le_bytes(word)
}

/// The common header of every PDU, validated against the lengths its type requires.
#[derive(Debug, Clone, Copy)]
struct CommonHeader {
    pdu_type: u8,
    pdu_bytes: usize,
}

/// Reads the common header at the start of `input`, if there are 8 bytes. The lengths are checked
/// against `expected` (type, hlen, plen) before the caller waits for the rest of the PDU, so a
/// hostile length can never make a connection wait for bytes that will not fit its buffer.
fn common_header(
    input: &[u8],
    expected: &[(u8, usize, usize)],
) -> Result<Option<CommonHeader>, ProtocolError> {
    if input.len() < COMMON_HEADER_BYTES {
        return Ok(None);
    }
    let pdu_type = input[0];
    let header_bytes = input[2];
    let pdu_bytes = u32_at(input, 4);
    let Some(&(_, hlen, plen)) = expected.iter().find(|(t, _, _)| *t == pdu_type) else {
        return Err(ProtocolError::PduUnexpected { pdu_type });
    };
    if usize::from(header_bytes) != hlen || pdu_bytes as usize != plen {
        return Err(ProtocolError::PduLengthInvalid { pdu_type, header_bytes, pdu_bytes });
    }
    assert!(plen <= PDU_BYTES_MAX);
    Ok(Some(CommonHeader { pdu_type, pdu_bytes: plen }))
}

fn push_common_header(out: &mut Vec<u8>, pdu_type: u8, flags: u8, hlen: u8, pdo: u8, plen: u32) {
    out.extend_from_slice(&[pdu_type, flags, hlen, pdo]);
    out.extend_from_slice(&plen.to_le_bytes());
}

/// The in-RAM block store: block `i` starts with `i` as a little-endian u64, so the client can
/// check that it got the block it asked for.
pub struct Store {
    bytes: Box<[u8]>,
}

impl Store {
    pub fn new() -> Store {
        // Filling every byte also faults in every page before the measurement starts.
        let mut bytes = vec![0xA5u8; STORE_BYTES].into_boxed_slice();
        for (index, block) in bytes.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            block[..8].copy_from_slice(&(index as u64).to_le_bytes());
        }
        Store { bytes }
    }

    pub fn block(&self, lba: u64) -> &[u8] {
        let index = (lba % STORE_BLOCKS) as usize;
        &self.bytes[index * BLOCK_BYTES..(index + 1) * BLOCK_BYTES]
    }
}

/// Target side of one connection.
#[derive(Debug, Default)]
pub struct TargetConnection {
    initialized: bool,
    submission_queue_head: u16,
}

impl TargetConnection {
    pub fn new() -> TargetConnection {
        TargetConnection::default()
    }

    /// Consumes the whole PDUs at the front of `input`, at most `BATCH_COMMANDS_MAX` commands,
    /// and appends their responses to `out` (which must have room for a full batch). Returns the
    /// bytes consumed; a partial PDU at the end is left for the next call.
    pub fn process(
        &mut self,
        input: &[u8],
        store: &Store,
        out: &mut Vec<u8>,
    ) -> Result<usize, ProtocolError> {
        assert!(out.capacity() - out.len() >= SERVER_OUTPUT_BUFFER_BYTES);
        let capacity_before = out.capacity();
        let mut consumed = 0;
        let mut commands = 0;
        while commands < BATCH_COMMANDS_MAX {
            let rest = &input[consumed..];
            let expected: &[(u8, usize, usize)] = if self.initialized {
                &[(PDU_TYPE_CAPSULE_CMD, CAPSULE_CMD_BYTES, CAPSULE_CMD_BYTES)]
            } else {
                &[(PDU_TYPE_IC_REQ, IC_PDU_BYTES, IC_PDU_BYTES)]
            };
            let Some(header) = common_header(rest, expected)? else { break };
            if rest.len() < header.pdu_bytes {
                break;
            }
            let pdu = &rest[..header.pdu_bytes];
            if header.pdu_type == PDU_TYPE_IC_REQ {
                push_common_header(out, PDU_TYPE_IC_RESP, 0, IC_PDU_BYTES as u8, 0, 128);
                out.resize(out.len() + IC_PDU_BYTES - COMMON_HEADER_BYTES, 0);
                self.initialized = true;
            } else {
                self.read_command(&pdu[COMMON_HEADER_BYTES..], store, out)?;
                commands += 1;
            }
            consumed += header.pdu_bytes;
        }
        // The buffer never grows: no allocation per I/O.
        assert_eq!(out.capacity(), capacity_before);
        Ok(consumed)
    }

    fn read_command(
        &mut self,
        sqe: &[u8],
        store: &Store,
        out: &mut Vec<u8>,
    ) -> Result<(), ProtocolError> {
        assert_eq!(sqe.len(), SQE_BYTES);
        let opcode = sqe[0];
        if opcode != OPCODE_READ {
            return Err(ProtocolError::OpcodeUnsupported { opcode });
        }
        let command_id = u16_at(sqe, 2);
        let namespace_id = u32_at(sqe, 4);
        if namespace_id != NAMESPACE_ID {
            return Err(ProtocolError::NamespaceUnknown { namespace_id });
        }
        let lba = u64_at(sqe, 40);
        let blocks_zero_based = u16_at(sqe, 48);
        if blocks_zero_based != 0 {
            return Err(ProtocolError::TransferLengthUnsupported { blocks_zero_based });
        }
        self.submission_queue_head = (self.submission_queue_head + 1) % SUBMISSION_QUEUE_ENTRIES;

        // C2HData: common header, cccid, reserved, datao, datal, reserved; then the data.
        push_common_header(
            out,
            PDU_TYPE_C2H_DATA,
            C2H_FLAG_LAST_PDU,
            C2H_HEADER_BYTES as u8,
            C2H_HEADER_BYTES as u8,
            C2H_PDU_BYTES as u32,
        );
        out.extend_from_slice(&command_id.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(BLOCK_BYTES as u32).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(store.block(lba));

        // CapsuleResp: common header, then the CQE (result, sqhd, sqid, command id, status).
        push_common_header(
            out,
            PDU_TYPE_CAPSULE_RESP,
            0,
            CAPSULE_RESP_BYTES as u8,
            0,
            CAPSULE_RESP_BYTES as u32,
        );
        out.extend_from_slice(&[0; 8]);
        out.extend_from_slice(&self.submission_queue_head.to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&command_id.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        Ok(())
    }
}

pub fn push_ic_req(out: &mut Vec<u8>) {
    push_common_header(out, PDU_TYPE_IC_REQ, 0, IC_PDU_BYTES as u8, 0, IC_PDU_BYTES as u32);
    out.resize(out.len() + IC_PDU_BYTES - COMMON_HEADER_BYTES, 0);
}

pub fn check_ic_resp(pdu: &[u8]) -> Result<(), ProtocolError> {
    match common_header(pdu, &[(PDU_TYPE_IC_RESP, IC_PDU_BYTES, IC_PDU_BYTES)])? {
        Some(_) if pdu.len() == IC_PDU_BYTES => Ok(()),
        _ => Err(ProtocolError::PduUnexpected { pdu_type: pdu.first().copied().unwrap_or(0) }),
    }
}

pub fn push_read_command(out: &mut Vec<u8>, command_id: u16, lba: u64) {
    let start = out.len();
    push_common_header(
        out,
        PDU_TYPE_CAPSULE_CMD,
        0,
        CAPSULE_CMD_BYTES as u8,
        0,
        CAPSULE_CMD_BYTES as u32,
    );
    out.resize(start + CAPSULE_CMD_BYTES, 0);
    let sqe = &mut out[start + COMMON_HEADER_BYTES..];
    sqe[0] = OPCODE_READ;
    sqe[2..4].copy_from_slice(&command_id.to_le_bytes());
    sqe[4..8].copy_from_slice(&NAMESPACE_ID.to_le_bytes());
    sqe[40..48].copy_from_slice(&lba.to_le_bytes());
    sqe[48..50].copy_from_slice(&0u16.to_le_bytes());
}

/// One response PDU as the initiator sees it.
#[derive(Debug, PartialEq, Eq)]
pub enum Response {
    /// C2HData: the command it answers and the first 8 bytes of the block.
    Data {
        command_id: u16,
        first_word: u64,
    },
    Completion {
        command_id: u16,
        status: u16,
    },
}

/// Parses the response PDU at the front of `input`, if it is whole. Returns it and its length.
pub fn parse_response(input: &[u8]) -> Result<Option<(Response, usize)>, ProtocolError> {
    let expected = [
        (PDU_TYPE_C2H_DATA, C2H_HEADER_BYTES, C2H_PDU_BYTES),
        (PDU_TYPE_CAPSULE_RESP, CAPSULE_RESP_BYTES, CAPSULE_RESP_BYTES),
    ];
    let Some(header) = common_header(input, &expected)? else { return Ok(None) };
    if input.len() < header.pdu_bytes {
        return Ok(None);
    }
    let pdu = &input[..header.pdu_bytes];
    let response = if header.pdu_type == PDU_TYPE_C2H_DATA {
        let data_bytes = u32_at(pdu, 16);
        if data_bytes as usize != BLOCK_BYTES || pdu[1] & C2H_FLAG_LAST_PDU == 0 {
            return Err(ProtocolError::PduLengthInvalid {
                pdu_type: header.pdu_type,
                header_bytes: pdu[2],
                pdu_bytes: data_bytes,
            });
        }
        Response::Data { command_id: u16_at(pdu, 8), first_word: u64_at(pdu, C2H_HEADER_BYTES) }
    } else {
        let cqe = &pdu[COMMON_HEADER_BYTES..];
        Response::Completion { command_id: u16_at(cqe, 12), status: u16_at(cqe, 14) }
    };
    Ok(Some((response, header.pdu_bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives a target with `input` delivered in pieces of `chunk_bytes`, as a socket would.
    fn serve_chunked(input: &[u8], chunk_bytes: usize, store: &Store) -> Vec<u8> {
        let mut target = TargetConnection::new();
        let mut pending = Vec::new();
        let mut responses = Vec::new();
        let mut out = Vec::with_capacity(SERVER_OUTPUT_BUFFER_BYTES);
        for chunk in input.chunks(chunk_bytes) {
            pending.extend_from_slice(chunk);
            loop {
                let consumed = target.process(&pending, store, &mut out).unwrap();
                responses.extend_from_slice(&out);
                out.clear();
                pending.drain(..consumed);
                if consumed == 0 {
                    break;
                }
            }
        }
        assert!(pending.is_empty());
        responses
    }

    #[test]
    fn reads_round_trip_whatever_the_chunking() {
        let store = Store::new();
        let lbas = [0u64, 1, STORE_BLOCKS - 1, STORE_BLOCKS + 5, u64::MAX];
        let mut input = Vec::new();
        push_ic_req(&mut input);
        for (command_id, lba) in lbas.iter().enumerate() {
            push_read_command(&mut input, command_id as u16, *lba);
        }
        for chunk_bytes in [1, 7, 72, 128, 1000, input.len()] {
            let responses = serve_chunked(&input, chunk_bytes, &store);
            check_ic_resp(&responses[..IC_PDU_BYTES]).unwrap();
            let mut rest = &responses[IC_PDU_BYTES..];
            for (command_id, lba) in lbas.iter().enumerate() {
                let command_id = command_id as u16;
                let (data, length) = parse_response(rest).unwrap().unwrap();
                assert_eq!(length, C2H_PDU_BYTES);
                assert_eq!(data, Response::Data { command_id, first_word: lba % STORE_BLOCKS });
                rest = &rest[length..];
                let (completion, length) = parse_response(rest).unwrap().unwrap();
                assert_eq!(completion, Response::Completion { command_id, status: 0 });
                rest = &rest[length..];
            }
            assert!(rest.is_empty());
        }
    }

    #[test]
    fn a_batch_stops_at_the_command_limit() {
        let store = Store::new();
        let mut input = Vec::new();
        push_ic_req(&mut input);
        for command_id in 0..(BATCH_COMMANDS_MAX as u16 + 3) {
            push_read_command(&mut input, command_id, 7);
        }
        let mut target = TargetConnection::new();
        let mut out = Vec::with_capacity(SERVER_OUTPUT_BUFFER_BYTES);
        let consumed = target.process(&input, &store, &mut out).unwrap();
        assert_eq!(consumed, IC_PDU_BYTES + BATCH_COMMANDS_MAX * CAPSULE_CMD_BYTES);
        assert_eq!(out.len(), IC_PDU_BYTES + BATCH_COMMANDS_MAX * RESPONSE_BYTES_PER_READ);
    }

    #[test]
    fn bad_pdus_are_errors_not_waits() {
        let store = Store::new();
        let mut out = Vec::with_capacity(SERVER_OUTPUT_BUFFER_BYTES);
        // A command before the connection is initialized.
        let mut command = Vec::new();
        push_read_command(&mut command, 1, 1);
        let error = TargetConnection::new().process(&command, &store, &mut out).unwrap_err();
        assert_eq!(error, ProtocolError::PduUnexpected { pdu_type: PDU_TYPE_CAPSULE_CMD });
        // A hostile length is rejected from the header alone.
        let mut ic_req = Vec::new();
        push_ic_req(&mut ic_req);
        ic_req[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        let error = TargetConnection::new().process(&ic_req[..8], &store, &mut out).unwrap_err();
        assert!(matches!(error, ProtocolError::PduLengthInvalid { .. }));
        // A write opcode.
        let mut input = Vec::new();
        push_ic_req(&mut input);
        push_read_command(&mut input, 1, 1);
        input[IC_PDU_BYTES + COMMON_HEADER_BYTES] = 0x01;
        let error = TargetConnection::new().process(&input, &store, &mut out).unwrap_err();
        assert_eq!(error, ProtocolError::OpcodeUnsupported { opcode: 0x01 });
    }
}
