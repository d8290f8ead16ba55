//! One NVMe/TCP connection on the target side: a submission/completion queue pair, sans-IO.
//!
//! Hot path. The node's driver owns the socket and a receive buffer; it calls
//! [`Queue::receive`] with the bytes it holds, which consumes whole PDUs only and returns how
//! many bytes it used, then sends [`Queue::output_chunks`] and executes
//! [`Queue::next_request`]s, handing each result back with [`Queue::complete`]. Time comes in as
//! `now_ms` arguments. A Read's data is sent from the buffer it was read into: its C2HData PDU
//! headers (and data digests) are output bytes, its data is spliced in between them.
//!
//! Every command holds at most one slot of a fixed table sized by the queue depth: a slot waits
//! for write data (by R2T and H2CData) or for the driver. Data buffers come from a per-queue pool
//! and travel with the storage request, so steady-state I/O allocates nothing.
//!
//! Errors follow the transport specification: a malformed PDU or a violation of the PDU sequence
//! is a fatal transport error, answered with one C2HTermReq carrying the fatal error status and
//! the offending header, after which the queue takes nothing more and wants to be closed. A bad
//! command is not fatal: it completes with an error status and the queue goes on.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use types::output::PieceSide;
use types::{AlignedBuf, SpliceOutput};

use super::pool::BufferPool;
use super::{
    Controller, NamespaceInfo, Target, AER_OUTSTANDING_MAX, C2H_DATA_PDU_BYTES_MAX,
    CONNECT_DEADLINE_MS, CPDA, IN_CAPSULE_DATA_BYTES_MAX, KEEP_ALIVE_GRANULARITY_MS, MAXH2CDATA,
    PDU_SIZE_MAX, QUEUE_ENTRIES_MAX, TRANSFER_BYTES_MAX,
};
use crate::command::{psdt, sgl_type, Cqe, DsmRange, Sqe, Status, DSM_RANGES_MAX, DSM_RANGE_BYTES};
use crate::pdu::{
    self, DataHeader, Decoded, Framing, ICReq, ICResp, Pdu, PduError, Role, PFV_1_0, R2T,
};

const _: () = assert!(QUEUE_ENTRIES_MAX as u32 <= u128::BITS, "slots are tracked in a u128");

/// Why a queue stopped. After any of these, send what [`Queue::output_chunks`] holds, then
/// close.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Terminated {
    #[error("fatal transport error, C2HTermReq sent: {0}")]
    ProtocolError(PduError),
    #[error("the host terminated the connection (H2CTermReq FES {fes:#x}, FEI {fei:#x})")]
    ByHost { fes: u16, fei: u32 },
    #[error("the host disconnected the queue")]
    Disconnected,
    #[error("the controller was shut down (admin queue closed or subsystem removed)")]
    ControllerClosed,
}

/// Identifies a storage request until its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId {
    slot: u16,
    generation: u32,
}

/// Why a storage request failed; each maps to the NVMe status the host sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageStatus {
    /// Anything else; the host may retry.
    Internal,
    UnrecoveredReadError,
    WriteFault,
    /// The volume has no space left for the write.
    CapacityExceeded,
    /// The range is outside the volume (it shrank since the command was checked).
    LbaOutOfRange,
    /// The volume is not available now; the host may retry.
    NotReady,
    /// The volume is read-only.
    WriteProtected,
    /// This path does not serve the volume now (a replica, or a primary that lost its term):
    /// a path error, so the host's multipath retries on another path.
    PathInaccessible,
}

impl StorageStatus {
    pub const fn nvme_status(self) -> Status {
        match self {
            StorageStatus::Internal => Status::INTERNAL_ERROR,
            StorageStatus::UnrecoveredReadError => Status::UNRECOVERED_READ_ERROR.with_dnr(),
            StorageStatus::WriteFault => Status::WRITE_FAULT.with_dnr(),
            StorageStatus::CapacityExceeded => Status::CAPACITY_EXCEEDED.with_dnr(),
            StorageStatus::LbaOutOfRange => Status::LBA_OUT_OF_RANGE.with_dnr(),
            StorageStatus::NotReady => Status::NAMESPACE_NOT_READY,
            StorageStatus::WriteProtected => Status::NAMESPACE_WRITE_PROTECTED.with_dnr(),
            StorageStatus::PathInaccessible => Status::ANA_INACCESSIBLE,
        }
    }
}

/// The ranges of a deallocation, kept in the 16-byte wire format inside a pooled buffer.
#[derive(Debug)]
pub struct DeallocateRanges {
    buf: AlignedBuf,
    count: usize,
}

impl DeallocateRanges {
    /// Number of ranges, zero-length ones included.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// `(lba, blocks)` of every range with at least one block; all lie within the namespace.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.buf[..self.count * DSM_RANGE_BYTES]
            .chunks_exact(DSM_RANGE_BYTES)
            .map(DsmRange::decode)
            .filter(|range| range.blocks > 0)
            .map(|range| (range.slba, range.blocks))
    }

    /// The buffer, to hand back with [`Queue::complete`].
    pub fn into_buf(self) -> AlignedBuf {
        self.buf
    }
}

/// What the driver must do for one command, in the namespace's logical blocks.
#[derive(Debug)]
pub enum StorageOperation {
    /// Fill `buf` (exactly `blocks` blocks long) and hand it back.
    Read {
        lba: u64,
        blocks: u32,
        buf: AlignedBuf,
    },
    /// Write `buf` durably, then hand it back.
    Write {
        lba: u64,
        blocks: u32,
        buf: AlignedBuf,
    },
    Flush,
    WriteZeroes {
        lba: u64,
        blocks: u32,
    },
    Deallocate {
        ranges: DeallocateRanges,
    },
}

/// A request for the driver's storage, for the volume named by `volume`.
#[derive(Debug)]
pub struct StorageRequest {
    pub id: RequestId,
    pub volume: u64,
    pub operation: StorageOperation,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitingICReq,
    AwaitingConnect,
    Connected,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    /// Waiting for write data in H2CData PDUs.
    ReceivingData,
    /// Queued for `next_request`.
    Ready,
    /// With the driver.
    InStorage,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum SlotCommand {
    Read { lba: u64, blocks: u32 },
    Write { lba: u64, blocks: u32 },
    Flush,
    WriteZeroes { lba: u64, blocks: u32 },
    Deallocate { ranges: u16 },
    Connect(Sqe),
}

pub(super) struct Slot {
    generation: u32,
    pub(super) state: SlotState,
    pub(super) cid: u16,
    pub(super) command: SlotCommand,
    pub(super) data_length: u32,
    received_bytes: u32,
    r2t_start: u32,
    r2t_end: u32,
    /// Set when data for this command arrived damaged; reported once all of it is in.
    failure: Option<Status>,
    pub(super) buf: Option<AlignedBuf>,
}

/// How a command handler finished.
pub(super) enum Outcome {
    /// Send a completion now, with this status and DW0/DW1.
    Complete { status: Status, result: u64 },
    /// The command holds a slot and completes later.
    Deferred,
}

impl Outcome {
    pub(super) const fn success(result: u64) -> Outcome {
        Outcome::Complete { status: Status::SUCCESS, result }
    }

    /// A failure the same command cannot overcome: sent with DNR.
    pub(super) const fn rejected(status: Status) -> Outcome {
        Outcome::Complete { status: status.with_dnr(), result: 0 }
    }

    pub(super) fn settle(result: Result<Outcome, Status>) -> Outcome {
        result.unwrap_or_else(Outcome::rejected)
    }
}

/// Where a command's host-to-controller data is.
pub(super) enum HostData<'a> {
    InCapsule(&'a [u8]),
    /// To be requested by R2T: this many bytes.
    Transport(u32),
}

/// State only the admin queue has.
pub(super) struct AdminState {
    pub(super) kato_ms: u32,
    pub(super) keep_alive_last_ms: u64,
    pub(super) async_event_configuration: u32,
    pub(super) aer_cids: VecDeque<u16>,
    pub(super) namespace_notice_masked: bool,
    pub(super) discovery_notice_masked: bool,
    pub(super) ana_notice_masked: bool,
}

/// One connection's queue. See the module documentation for how a driver uses it.
pub struct Queue {
    pub(super) target: Arc<Target>,
    peer: String,
    /// The listener port the connection came in on.
    pub(super) port_id: u16,
    /// The host disabled SQ flow control in Connect (CATTR bit 2): successful reads end with a
    /// C2HData SUCCESS flag instead of a CapsuleResp.
    pub(super) sq_flow_control_disabled: bool,
    phase: Phase,
    pub(super) framing: Framing,
    created_ms: u64,
    pub(super) qid: u16,
    /// Submission queue entries (SQSIZE + 1); 0 before Connect.
    pub(super) entries: u16,
    pub(super) sq_head: u16,
    pub(super) controller: Option<Arc<Controller>>,
    pub(super) namespace: Option<NamespaceInfo>,
    pub(super) slots: Vec<Slot>,
    /// Bit `i` is set while slot `i` is taken; QUEUE_ENTRIES_MAX slots fit in 128 bits.
    slots_busy: u128,
    /// The CID of each taken slot, kept apart from the slots so that the Command ID conflict
    /// check reads 256 bytes, not the whole table.
    slot_cids: [u16; QUEUE_ENTRIES_MAX as usize],
    /// Whether this queue holds its I/O queue ID in the controller (released exactly once).
    holds_qid: bool,
    ready: VecDeque<u16>,
    pub(super) pool: BufferPool,
    /// PDUs to send, with Read data spliced in from its buffers.
    output: SpliceOutput,
    /// Admin command data is built here before it is sent.
    pub(super) scratch: Vec<u8>,
    pub(super) admin: AdminState,
    terminated: Option<Terminated>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("peer", &self.peer)
            .field("phase", &self.phase)
            .field("qid", &self.qid)
            .field("cntlid", &self.controller.as_ref().map(|c| c.cntlid))
            .field("slots_in_use", &self.slots_busy.count_ones())
            .field("terminated", &self.terminated)
            .finish()
    }
}

impl Queue {
    /// A queue for a new connection from `peer` (used in messages only), accepted at `now_ms`
    /// on the first listener's port ([`Target::default_port_id`]).
    pub fn new(target: Arc<Target>, peer: String, now_ms: u64) -> Queue {
        let port_id = target.default_port_id();
        Queue::new_on_port(target, peer, port_id, now_ms)
    }

    /// A queue for a connection accepted on the listener whose port ID is `port_id`: its
    /// controller reports that port's ANA state.
    pub fn new_on_port(target: Arc<Target>, peer: String, port_id: u16, now_ms: u64) -> Queue {
        let slots = (0..QUEUE_ENTRIES_MAX)
            .map(|_| Slot {
                generation: 0,
                state: SlotState::Free,
                cid: 0,
                command: SlotCommand::Flush,
                data_length: 0,
                received_bytes: 0,
                r2t_start: 0,
                r2t_end: 0,
                failure: None,
                buf: None,
            })
            .collect();
        let pool = BufferPool::new(target.config().buffer_retained_bytes_max);
        let mut framing = Framing::new(Role::Controller, PDU_SIZE_MAX);
        framing.receive_pda = CPDA;
        Queue {
            target,
            peer,
            port_id,
            sq_flow_control_disabled: false,
            phase: Phase::AwaitingICReq,
            framing,
            created_ms: now_ms,
            qid: 0,
            entries: 0,
            sq_head: 0,
            controller: None,
            namespace: None,
            slots,
            slots_busy: 0,
            slot_cids: [0; QUEUE_ENTRIES_MAX as usize],
            holds_qid: false,
            ready: VecDeque::with_capacity(usize::from(QUEUE_ENTRIES_MAX)),
            pool,
            output: SpliceOutput::new(),
            scratch: Vec::new(),
            admin: AdminState {
                kato_ms: 0,
                keep_alive_last_ms: now_ms,
                async_event_configuration: 0,
                aer_cids: VecDeque::with_capacity(AER_OUTSTANDING_MAX),
                namespace_notice_masked: false,
                discovery_notice_masked: false,
                ana_notice_masked: false,
            },
            terminated: None,
        }
    }

    /// The largest PDU the queue accepts: the driver's receive buffer must hold this many bytes.
    pub const fn pdu_size_max() -> usize {
        PDU_SIZE_MAX as usize
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The queue ID once connected (0: admin queue).
    pub fn qid(&self) -> Option<u16> {
        (self.phase == Phase::Connected).then_some(self.qid)
    }

    /// The controller ID once connected.
    pub fn cntlid(&self) -> Option<u16> {
        self.controller.as_ref().map(|controller| controller.cntlid)
    }

    /// Consumes the whole PDUs at the start of `input` and returns how many bytes they took; the
    /// driver keeps the rest and offers it again with more. On `Err` the queue is finished: send
    /// [`Queue::output_chunks`], then close the connection.
    pub fn receive(&mut self, input: &[u8], now_ms: u64) -> Result<usize, Terminated> {
        // A controller closed elsewhere (its subsystem deleted, its admin queue gone) must not
        // answer one more command: notice it before handling anything new.
        self.poll(now_ms);
        self.check_open()?;
        let mut consumed = 0;
        // Each iteration consumes at least one common header, so this loop is bounded by
        // input.len() / 8.
        while consumed < input.len() {
            let rest = &input[consumed..];
            let (pdu, length, data_intact) = match pdu::decode(rest, &self.framing) {
                Ok(Decoded::Incomplete { .. }) => break,
                Ok(Decoded::Pdu { pdu, consumed_bytes }) => (pdu, consumed_bytes, true),
                Ok(Decoded::DataDigestMismatch { pdu, consumed_bytes, .. }) => {
                    (pdu, consumed_bytes, false)
                }
                Err(error) => return Err(self.fail(error, rest)),
            };
            if let Err(error) = self.handle_pdu(pdu, data_intact, now_ms) {
                return Err(self.fail(error, rest));
            }
            consumed += length;
            self.check_open()?;
        }
        self.poll(now_ms);
        Ok(consumed)
    }

    /// Work that does not wait for input: delivers pending asynchronous events and notices a
    /// controller shut down elsewhere. Call it after `Target::notify_*` and on a timer.
    pub fn poll(&mut self, _now_ms: u64) {
        if self.terminated.is_some() {
            return;
        }
        let Some(controller) = self.controller.as_ref() else { return };
        if controller.closed.load(Ordering::Acquire) {
            self.terminate(Terminated::ControllerClosed);
            return;
        }
        if self.qid == 0 {
            let controller = Arc::clone(controller);
            self.deliver_async_events(&controller);
        }
    }

    /// The bytes waiting to be sent, as chunks to send in this order (PDU bytes and Read data
    /// buffers; none is empty).
    pub fn output_chunks(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.output.chunks()
    }

    /// Bytes waiting to be sent: the sum of [`Queue::output_chunks`]' lengths.
    pub fn output_len(&self) -> usize {
        self.output.len()
    }

    /// Drops the first `length` bytes of [`Queue::output_chunks`], which the driver has sent; a
    /// Read buffer sent whole goes back to the pool.
    pub fn consume_output(&mut self, length: usize) {
        self.output.consume(length);
        while let Some(buf) = self.output.take_released() {
            self.pool.give(buf);
        }
    }

    /// The next storage request for the driver, if any.
    pub fn next_request(&mut self) -> Option<StorageRequest> {
        let index = self.ready.pop_front()?;
        let volume = self.namespace.as_ref().map_or(0, |namespace| namespace.volume);
        let slot = &mut self.slots[usize::from(index)];
        assert_eq!(slot.state, SlotState::Ready);
        slot.state = SlotState::InStorage;
        let operation = match slot.command {
            SlotCommand::Read { lba, blocks } => {
                StorageOperation::Read { lba, blocks, buf: take_buf(slot) }
            }
            SlotCommand::Write { lba, blocks } => {
                StorageOperation::Write { lba, blocks, buf: take_buf(slot) }
            }
            SlotCommand::Flush => StorageOperation::Flush,
            SlotCommand::WriteZeroes { lba, blocks } => {
                StorageOperation::WriteZeroes { lba, blocks }
            }
            SlotCommand::Deallocate { ranges } => StorageOperation::Deallocate {
                ranges: DeallocateRanges { buf: take_buf(slot), count: usize::from(ranges) },
            },
            SlotCommand::Connect(_) => unreachable!("Connect never goes to storage"),
        };
        Some(StorageRequest {
            id: RequestId { slot: index, generation: slot.generation },
            volume,
            operation,
        })
    }

    /// Hands back the result of a storage request, with its buffer (a Read must return its
    /// filled buffer; others may return theirs for reuse). After termination it only recycles.
    pub fn complete(
        &mut self,
        id: RequestId,
        result: Result<(), StorageStatus>,
        mut buf: Option<AlignedBuf>,
    ) {
        let index = usize::from(id.slot);
        let slot = &self.slots[index];
        assert!(
            slot.generation == id.generation && slot.state == SlotState::InStorage,
            "completion for a request that is not with the driver: {id:?}"
        );
        let (cid, command, data_length) = (slot.cid, slot.command, slot.data_length);
        if self.terminated.is_none() {
            let status = match result {
                Ok(()) => {
                    if let SlotCommand::Read { .. } = command {
                        let Some(data) = buf.take() else {
                            panic!("a Read completed without its buffer: {id:?}");
                        };
                        assert!(data.len() >= data_length as usize, "Read buffer shrank");
                        // Without SQ flow control the host needs no SQHD, so the last C2HData
                        // PDU says SUCCESS and no response capsule follows.
                        let success_flag = self.sq_flow_control_disabled;
                        let (framing, length) = (&self.framing, data_length as usize);
                        // Sent from the driver's buffer between the PDU headers, not copied.
                        self.output.push_buffer(
                            data,
                            c2h_pieces(length),
                            |bytes, range, piece, side| match side {
                                PieceSide::Before => {
                                    let header = c2h_header(cid, &range, length, success_flag);
                                    pdu::encode_data_pdu_header(bytes, framing, &header);
                                }
                                PieceSide::After => pdu::push_data_digest(bytes, framing, piece),
                            },
                        );
                        if success_flag {
                            None
                        } else {
                            Some(Status::SUCCESS)
                        }
                    } else {
                        Some(Status::SUCCESS)
                    }
                }
                Err(error) => Some(error.nvme_status()),
            };
            if let Some(status) = status {
                self.respond(cid, status, 0);
            }
        }
        if let Some(buf) = buf {
            self.pool.give(buf);
        }
        self.free_slot(index);
    }

    /// Whether the connection should be closed (after sending the pending output).
    pub fn wants_close(&self) -> bool {
        self.terminated.is_some()
            || self.controller.as_ref().is_some_and(|c| c.closed.load(Ordering::Acquire))
    }

    /// Whether the host has failed to keep the association alive: on the admin queue, no Keep
    /// Alive within KATO (rounded up to the keep alive granularity); before Connect, no Connect
    /// within [`CONNECT_DEADLINE_MS`]. The driver closes the connection when this is true.
    pub fn keep_alive_expired(&self, now_ms: u64) -> bool {
        match self.phase {
            Phase::AwaitingICReq | Phase::AwaitingConnect => {
                now_ms.saturating_sub(self.created_ms) > CONNECT_DEADLINE_MS
            }
            Phase::Connected if self.qid == 0 && self.admin.kato_ms > 0 => {
                let timeout_ms = u64::from(self.admin.kato_ms.div_ceil(KEEP_ALIVE_GRANULARITY_MS))
                    * u64::from(KEEP_ALIVE_GRANULARITY_MS);
                now_ms.saturating_sub(self.admin.keep_alive_last_ms) > timeout_ms
            }
            Phase::Connected => false,
        }
    }

    fn check_open(&self) -> Result<(), Terminated> {
        match &self.terminated {
            Some(terminated) => Err(terminated.clone()),
            None => Ok(()),
        }
    }

    /// Stops the queue: drops queued requests (requests with the driver still complete).
    fn terminate(&mut self, reason: Terminated) {
        if self.terminated.is_some() {
            return;
        }
        self.terminated = Some(reason);
        while let Some(index) = self.ready.pop_front() {
            let index = usize::from(index);
            if let Some(buf) = self.slots[index].buf.take() {
                self.pool.give(buf);
            }
            self.free_slot(index);
        }
    }

    /// A fatal transport error: one C2HTermReq with the offending header, then termination.
    fn fail(&mut self, error: PduError, pdu_bytes: &[u8]) -> Terminated {
        // The header as its HLEN claims, but at least the common header, as far as it arrived.
        let header_bytes = pdu_bytes
            .get(2)
            .map_or(pdu::COMMON_HEADER_BYTES, |hlen| usize::from(*hlen))
            .max(pdu::COMMON_HEADER_BYTES);
        let header = &pdu_bytes[..header_bytes.min(pdu_bytes.len())];
        pdu::encode_term_req_for(self.output.bytes_mut(), Role::Controller, &error, header);
        let terminated = Terminated::ProtocolError(error);
        self.terminate(terminated.clone());
        terminated
    }

    fn handle_pdu(&mut self, pdu: Pdu<'_>, data_intact: bool, now_ms: u64) -> Result<(), PduError> {
        match pdu {
            Pdu::H2CTermReq(term) => {
                self.terminate(Terminated::ByHost { fes: term.fes, fei: term.fei });
                Ok(())
            }
            Pdu::ICReq(icreq) => self.handle_icreq(icreq),
            _ if self.phase == Phase::AwaitingICReq => {
                Err(PduError::SequenceError { reason: "PDU before ICReq" })
            }
            Pdu::CapsuleCmd(capsule) => {
                self.handle_capsule(capsule.sqe, capsule.data, data_intact, now_ms)
            }
            Pdu::H2CData(header, data) => self.handle_h2c_data(header, data, data_intact, now_ms),
            // The decoder refuses PDUs a host does not send.
            _ => Err(PduError::InvalidHeaderField { offset: 0, reason: "not a host PDU" }),
        }
    }

    fn handle_icreq(&mut self, icreq: ICReq) -> Result<(), PduError> {
        if self.phase != Phase::AwaitingICReq {
            return Err(PduError::SequenceError { reason: "second ICReq" });
        }
        if icreq.pfv != PFV_1_0 {
            return Err(PduError::UnsupportedParameter { offset: 8, reason: "PDU format version" });
        }
        // Both digests are offered to whoever asks; data alignment follows the host's HPDA.
        let response = ICResp {
            pfv: PFV_1_0,
            cpda: CPDA,
            header_digest: icreq.header_digest,
            data_digest: icreq.data_digest,
            maxh2cdata: MAXH2CDATA,
        };
        pdu::encode_ic_resp(self.output.bytes_mut(), &response);
        self.framing.header_digest = icreq.header_digest;
        self.framing.data_digest = icreq.data_digest;
        self.framing.send_pda = icreq.hpda;
        self.phase = Phase::AwaitingConnect;
        Ok(())
    }

    fn outstanding(&self) -> usize {
        self.slots_busy.count_ones() as usize + self.admin.aer_cids.len()
    }

    fn cid_in_use(&self, cid: u16) -> bool {
        let mut busy = self.slots_busy;
        // At most QUEUE_ENTRIES_MAX iterations: one per set bit.
        while busy != 0 {
            let index = busy.trailing_zeros() as usize;
            if self.slot_cids[index] == cid {
                return true;
            }
            busy &= busy - 1;
        }
        self.admin.aer_cids.contains(&cid)
    }

    fn handle_capsule(
        &mut self,
        sqe: Sqe,
        data: &[u8],
        data_intact: bool,
        now_ms: u64,
    ) -> Result<(), PduError> {
        // A host may not have more commands outstanding than its submission queue holds; one
        // more than SQSIZE is tolerated, which still fits the slot table.
        let outstanding_max =
            if self.entries == 0 { QUEUE_ENTRIES_MAX } else { self.entries } as usize;
        if self.outstanding() >= outstanding_max {
            return Err(PduError::SequenceError {
                reason: "more commands outstanding than the submission queue holds",
            });
        }
        if self.entries > 0 {
            self.sq_head = (self.sq_head + 1) % self.entries;
        }
        let cid = sqe.cid();
        let outcome = if self.cid_in_use(cid) {
            Outcome::rejected(Status::COMMAND_ID_CONFLICT)
        } else if !data_intact {
            Outcome::Complete { status: Status::TRANSIENT_TRANSPORT_ERROR, result: 0 }
        } else if self.phase != Phase::Connected {
            self.execute_unconnected(sqe, data, now_ms)
        } else if self.qid == 0 {
            self.execute_admin(sqe, data, now_ms)
        } else {
            self.execute_io(sqe, data)
        };
        if let Outcome::Complete { status, result } = outcome {
            self.respond(cid, status, result);
        }
        Ok(())
    }

    /// Before Connect only Connect is accepted.
    fn execute_unconnected(&mut self, sqe: Sqe, data: &[u8], now_ms: u64) -> Outcome {
        use crate::command::{fctype, FABRICS_OPCODE};
        if sqe.opcode() == FABRICS_OPCODE && sqe.fctype() == fctype::CONNECT {
            self.begin_connect(sqe, data, now_ms)
        } else {
            Outcome::rejected(Status::COMMAND_SEQUENCE_ERROR)
        }
    }

    /// Called by the Connect handler once it accepted the queue.
    pub(super) fn connected(
        &mut self,
        controller: Arc<Controller>,
        qid: u16,
        sqsize: u16,
        kato_ms: u32,
        now_ms: u64,
    ) {
        self.namespace = controller.namespace.clone();
        self.controller = Some(controller);
        self.qid = qid;
        self.holds_qid = qid != 0;
        self.entries = sqsize + 1;
        // The Connect command itself took the first entry.
        self.sq_head = 1 % self.entries;
        self.phase = Phase::Connected;
        if qid == 0 {
            self.admin.kato_ms = kato_ms;
            self.admin.keep_alive_last_ms = now_ms;
        }
    }

    /// Disconnect: the queue ID is free for a new connection at once, before this one closes.
    pub(super) fn mark_disconnected(&mut self) {
        self.release_qid();
        self.terminate(Terminated::Disconnected);
    }

    fn release_qid(&mut self) {
        if self.holds_qid {
            self.holds_qid = false;
            if let Some(controller) = &self.controller {
                controller.release_io_queue(self.qid);
            }
        }
    }

    /// Appends a CapsuleResp for `cid`.
    pub(super) fn respond(&mut self, cid: u16, status: Status, result: u64) {
        let cqe = Cqe { result, sqhd: self.sq_head, sqid: self.qid, cid, status };
        pdu::encode_capsule_resp(self.output.bytes_mut(), &self.framing, &cqe);
    }

    /// Sends the first `length` bytes of the scratch buffer as C2H data of `cid`.
    pub(super) fn send_scratch(&mut self, cid: u16, length: usize) {
        let length = length.min(self.scratch.len());
        let (framing, data) = (&self.framing, &self.scratch[..length]);
        let output = self.output.bytes_mut();
        for range in c2h_pieces(length) {
            let header = c2h_header(cid, &range, length, false);
            pdu::encode_data_pdu(output, framing, &header, &data[range]);
        }
    }

    // --- Data descriptors ---

    /// Checks the data pointer of a command that sends data to the host and returns its length.
    pub(super) fn controller_to_host_length(sqe: &Sqe) -> Result<u32, Status> {
        check_psdt(sqe)?;
        let sgl = sqe.sgl();
        match sgl.descriptor_type {
            sgl_type::TRANSPORT_DATA_BLOCK => {}
            sgl_type::DATA_BLOCK_OFFSET => return Err(Status::INVALID_FIELD),
            _ => return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
        if sgl.length > TRANSFER_BYTES_MAX {
            return Err(Status::INVALID_FIELD);
        }
        Ok(sgl.length)
    }

    /// Checks the data pointer of a command that sends data to the controller and says where
    /// the data is.
    pub(super) fn host_data<'a>(sqe: &Sqe, capsule_data: &'a [u8]) -> Result<HostData<'a>, Status> {
        check_psdt(sqe)?;
        let sgl = sqe.sgl();
        match sgl.descriptor_type {
            sgl_type::DATA_BLOCK_OFFSET => {
                if sgl.length > IN_CAPSULE_DATA_BYTES_MAX {
                    return Err(Status::DATA_SGL_LENGTH_INVALID);
                }
                let end = sgl.address.checked_add(u64::from(sgl.length));
                match end {
                    Some(end) if end <= capsule_data.len() as u64 => {
                        Ok(HostData::InCapsule(&capsule_data[sgl.address as usize..end as usize]))
                    }
                    _ if sgl.address > 0 => Err(Status::SGL_OFFSET_INVALID),
                    _ => Err(Status::DATA_SGL_LENGTH_INVALID),
                }
            }
            sgl_type::TRANSPORT_DATA_BLOCK => {
                if !capsule_data.is_empty() {
                    // The capsule carries data its descriptor does not describe.
                    return Err(Status::DATA_SGL_LENGTH_INVALID);
                }
                if sgl.length > TRANSFER_BYTES_MAX {
                    return Err(Status::INVALID_FIELD);
                }
                Ok(HostData::Transport(sgl.length))
            }
            _ => Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
        }
    }

    // --- Slots ---

    /// Takes a free slot for `cid`. The caller checked queue depth, so one is free.
    pub(super) fn allocate_slot(
        &mut self,
        cid: u16,
        command: SlotCommand,
        data_length: u32,
        buf: Option<AlignedBuf>,
        state: SlotState,
    ) -> usize {
        let index = (!self.slots_busy).trailing_zeros() as usize;
        assert!(index < self.slots.len(), "queue depth is checked before a slot is taken");
        self.slots_busy |= 1 << index;
        self.slot_cids[index] = cid;
        let slot = &mut self.slots[index];
        assert_eq!(slot.state, SlotState::Free);
        slot.generation = slot.generation.wrapping_add(1);
        slot.state = state;
        slot.cid = cid;
        slot.command = command;
        slot.data_length = data_length;
        slot.received_bytes = 0;
        slot.r2t_start = 0;
        slot.r2t_end = 0;
        slot.failure = None;
        slot.buf = buf;
        if state == SlotState::Ready {
            self.ready.push_back(index as u16);
        }
        index
    }

    pub(super) fn queue_for_storage(&mut self, index: usize) {
        self.slots[index].state = SlotState::Ready;
        self.ready.push_back(index as u16);
    }

    pub(super) fn free_slot(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        assert!(slot.state != SlotState::Free, "slot freed twice");
        assert!(slot.buf.is_none(), "slot freed with its buffer");
        slot.state = SlotState::Free;
        self.slots_busy &= !(1 << index);
    }

    /// Starts receiving a command's data by R2T.
    pub(super) fn send_r2t(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        assert_eq!(slot.state, SlotState::ReceivingData);
        let offset = slot.received_bytes;
        let length = (slot.data_length - offset).min(MAXH2CDATA);
        assert!(length > 0, "an R2T asks for data");
        slot.r2t_start = offset;
        slot.r2t_end = offset + length;
        let r2t = R2T { cccid: slot.cid, ttag: index as u16, r2to: offset, r2tl: length };
        pdu::encode_r2t(self.output.bytes_mut(), &self.framing, &r2t);
    }

    fn handle_h2c_data(
        &mut self,
        header: DataHeader,
        data: &[u8],
        data_intact: bool,
        now_ms: u64,
    ) -> Result<(), PduError> {
        if header.datal > MAXH2CDATA {
            return Err(PduError::DataLimitExceeded { reason: "H2CData larger than MAXH2CDATA" });
        }
        let index = usize::from(header.ttag);
        let slot = match self.slots.get_mut(index) {
            Some(slot) if slot.state == SlotState::ReceivingData => slot,
            _ => {
                return Err(PduError::InvalidHeaderField {
                    offset: 10,
                    reason: "TTAG names no transfer in progress",
                })
            }
        };
        if slot.cid != header.cccid {
            return Err(PduError::InvalidHeaderField {
                offset: 8,
                reason: "CCCID does not match the R2T",
            });
        }
        // DATAO + DATAL does not overflow: the decoder checked.
        let end = header.datao + header.datal;
        if header.datao < slot.r2t_start || end > slot.r2t_end {
            return Err(PduError::DataOutOfRange { reason: "H2CData outside the R2T" });
        }
        if header.datao != slot.received_bytes {
            return Err(PduError::SequenceError { reason: "H2CData out of order" });
        }
        if data_intact {
            let Some(buf) = slot.buf.as_mut() else {
                unreachable!("a slot receiving data has a buffer")
            };
            buf[header.datao as usize..end as usize].copy_from_slice(data);
        } else {
            slot.failure = Some(Status::TRANSIENT_TRANSPORT_ERROR);
        }
        slot.received_bytes = end;
        if slot.received_bytes < slot.r2t_end {
            return Ok(());
        }
        if let Some(status) = slot.failure {
            let cid = slot.cid;
            if let Some(buf) = slot.buf.take() {
                self.pool.give(buf);
            }
            self.free_slot(index);
            self.respond(cid, status, 0);
        } else if slot.received_bytes < slot.data_length {
            self.send_r2t(index);
        } else {
            self.data_received(index, now_ms);
        }
        Ok(())
    }

    /// All data of the command in slot `index` arrived (in the capsule or by H2CData).
    pub(super) fn data_received(&mut self, index: usize, now_ms: u64) {
        let slot = &self.slots[index];
        let cid = slot.cid;
        match slot.command {
            SlotCommand::Write { .. } => self.queue_for_storage(index),
            SlotCommand::Deallocate { ranges } => {
                match self.check_deallocate_ranges(index, usize::from(ranges)) {
                    Ok(true) => self.queue_for_storage(index),
                    Ok(false) => self.finish_without_storage(index, Status::SUCCESS),
                    Err(status) => self.finish_without_storage(index, status.with_dnr()),
                }
            }
            SlotCommand::Connect(sqe) => {
                let Some(buf) = self.slots[index].buf.take() else {
                    unreachable!("a Connect slot has a buffer")
                };
                self.free_slot(index);
                let outcome = self.connect(sqe, &buf, now_ms);
                self.pool.give(buf);
                if let Outcome::Complete { status, result } = outcome {
                    self.respond(cid, status, result);
                }
            }
            SlotCommand::Read { .. } | SlotCommand::Flush | SlotCommand::WriteZeroes { .. } => {
                unreachable!("command without host data")
            }
        }
    }

    fn finish_without_storage(&mut self, index: usize, status: Status) {
        let cid = self.slots[index].cid;
        if let Some(buf) = self.slots[index].buf.take() {
            self.pool.give(buf);
        }
        self.free_slot(index);
        self.respond(cid, status, 0);
    }

    /// Validates the Dataset Management ranges held in slot `index`; Ok(false) when no range
    /// has any block, so there is nothing to do.
    fn check_deallocate_ranges(&self, index: usize, count: usize) -> Result<bool, Status> {
        assert!(count <= DSM_RANGES_MAX);
        let size_blocks = self.namespace.as_ref().map_or(0, NamespaceInfo::size_blocks);
        let Some(buf) = self.slots[index].buf.as_ref() else {
            unreachable!("a Deallocate slot has a buffer")
        };
        let mut any = false;
        for bytes in buf[..count * DSM_RANGE_BYTES].chunks_exact(DSM_RANGE_BYTES) {
            let range = DsmRange::decode(bytes);
            if range.blocks == 0 {
                continue;
            }
            match range.slba.checked_add(u64::from(range.blocks)) {
                Some(end) if end <= size_blocks => any = true,
                _ => return Err(Status::LBA_OUT_OF_RANGE),
            }
        }
        Ok(any)
    }

    // --- Asynchronous events ---

    fn deliver_async_events(&mut self, controller: &Controller) {
        use crate::command::log_page;
        const NOTICE: u32 = 2;
        const NAMESPACE_ATTRIBUTE_CHANGED: u32 = 0x00;
        const ANA_CHANGE: u32 = 0x03;
        const DISCOVERY_LOG_CHANGED: u32 = 0xF0;
        let notices = [
            (
                &controller.namespace_notice_pending,
                ASYNC_EVENT_NAMESPACE_ATTRIBUTE,
                NAMESPACE_ATTRIBUTE_CHANGED,
                log_page::CHANGED_NAMESPACE_LIST,
            ),
            (&controller.ana_notice_pending, ASYNC_EVENT_ANA_CHANGE, ANA_CHANGE, log_page::ANA),
            (
                &controller.discovery_notice_pending,
                ASYNC_EVENT_DISCOVERY_CHANGE,
                DISCOVERY_LOG_CHANGED,
                log_page::DISCOVERY,
            ),
        ];
        for (pending, enable, information, log_page) in notices {
            let masked = match information {
                NAMESPACE_ATTRIBUTE_CHANGED => &mut self.admin.namespace_notice_masked,
                ANA_CHANGE => &mut self.admin.ana_notice_masked,
                _ => &mut self.admin.discovery_notice_masked,
            };
            if self.admin.async_event_configuration & enable == 0 || *masked {
                // Not reported: disabled, or already reported and its log not yet read (which
                // shows this change too).
                pending.store(false, Ordering::Release);
                continue;
            }
            if self.admin.aer_cids.is_empty() || !pending.swap(false, Ordering::AcqRel) {
                continue;
            }
            *masked = true;
            let Some(cid) = self.admin.aer_cids.pop_front() else { continue };
            let result = NOTICE | (information << 8) | (u32::from(log_page) << 16);
            self.respond(cid, Status::SUCCESS, u64::from(result));
        }
    }
}

/// Asynchronous Event Configuration bits (Set Features 0Bh CDW11) and OAES bits this target
/// reports: namespace attribute notices, ANA change notices, discovery log page change notices.
pub(super) const ASYNC_EVENT_NAMESPACE_ATTRIBUTE: u32 = 1 << 8;
pub(super) const ASYNC_EVENT_ANA_CHANGE: u32 = 1 << 11;
pub(super) const ASYNC_EVENT_DISCOVERY_CHANGE: u32 = 1 << 31;

impl Drop for Queue {
    fn drop(&mut self) {
        self.release_qid();
        if let Some(controller) = self.controller.take() {
            if self.qid == 0 {
                self.target.remove_controller(&controller);
            }
        }
    }
}

fn take_buf(slot: &mut Slot) -> AlignedBuf {
    slot.buf.take().expect("a slot queued for storage holds its buffer")
}

fn check_psdt(sqe: &Sqe) -> Result<(), Status> {
    match sqe.psdt() {
        psdt::SGL_METADATA_BUFFER | psdt::SGL_METADATA_SGL => Ok(()),
        _ => Err(Status::INVALID_FIELD),
    }
}

/// The C2HData PDUs' pieces of `length` bytes of data: at most [`C2H_DATA_PDU_BYTES_MAX`]
/// bytes each (at most one transfer's length / that many).
fn c2h_pieces(length: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let chunk = C2H_DATA_PDU_BYTES_MAX as usize;
    (0..length).step_by(chunk).map(move |start| start..(start + chunk).min(length))
}

/// The header of the C2HData PDU carrying `range` of `length` bytes for `cid`; with `success`,
/// the last one carries the SUCCESS flag and stands for the response.
fn c2h_header(
    cid: u16,
    range: &std::ops::Range<usize>,
    length: usize,
    success: bool,
) -> DataHeader {
    let last = range.end == length;
    DataHeader {
        cccid: cid,
        ttag: 0,
        datao: range.start as u32,
        datal: range.len() as u32,
        last,
        success: success && last,
    }
}
