//! One NVMe/TCP queue pair on its own TCP connection: the ICReq/ICResp handshake, a send buffer
//! that submissions are encoded into, a receive buffer that PDUs are decoded from, and the
//! per-command state that checks every PDU the controller sends against what was asked.
//!
//! Hot path. Submitting encodes the command capsule (and in-capsule data) into the send buffer
//! and returns; [`QueuePair::drive`] writes what is pending and reads what arrived in the same
//! wait, so neither direction can stall the other on a full TCP window. Nothing is allocated per
//! command: the buffers are sized when the queue opens and the caller's data buffers move in and
//! out with their commands. Data is copied once each way, between the caller's buffer and the
//! send or receive buffer. The admin queue and the I/O queues share this code; only their depth,
//! in-capsule size and transfer size differ.
//!
//! Every byte layout is `nvmf`'s: this module only calls its encoders and `decode`.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::Duration;

use nvmf::command::Cqe;
use nvmf::command::{SglDescriptor, Sqe, Status};
use nvmf::pdu::{
    self, encode_capsule_cmd, encode_data_pdu, encode_ic_req, encode_term_req_for, DataHeader,
    Decoded, Framing, ICReq, Pdu, PduError, Role, DIGEST_BYTES, PDU_HEADER_BYTES_MAX, PFV_1_0, R2T,
};
use tokio::io::Interest;
use tokio::net::TcpStream;
use types::AlignedBuf;

use crate::error::InitiatorError;

/// Deepest queue this initiator opens (commands in flight on one queue).
pub const QUEUE_DEPTH_MAX: u16 = 1024;
/// Depth of the admin queue (its Connect SQSIZE is one less). The NVMe minimum admin queue.
pub const ADMIN_QUEUE_DEPTH: u16 = 32;
/// In-capsule data the admin queue accepts: fixed at 8 KiB by the NVMe/TCP transport.
pub const ADMIN_IN_CAPSULE_BYTES: usize = 8192;
/// Largest data transfer of one command this initiator issues, whatever the controller's MDTS
/// allows; longer I/O is split into several commands.
pub const COMMAND_TRANSFER_BYTES_MAX: usize = 1 << 20;
/// Room in the receive buffer beyond the largest PDU, so one read can take in several PDUs.
const RECEIVE_SLACK_BYTES: usize = 64 * 1024;
/// The send buffer reserved at open covers this much in-capsule data per command; it only grows
/// beyond it for large writes answered through R2T.
const SEND_RESERVE_DATA_BYTES_PER_COMMAND: usize = 16 * 1024;

const _: () = assert!(ADMIN_QUEUE_DEPTH <= QUEUE_DEPTH_MAX);
const _: () = assert!(COMMAND_TRANSFER_BYTES_MAX % types::BLOCK_SIZE_BYTES as usize == 0);

/// Everything about one queue that is fixed when it opens.
#[derive(Debug, Clone)]
pub(crate) struct QueueParams {
    pub address: SocketAddr,
    pub qid: u16,
    pub depth: u16,
    /// Largest write data sent inside the command capsule; longer data goes by R2T.
    pub in_capsule_bytes_max: usize,
    /// Largest data transfer of one command (MDTS, bounded by [`COMMAND_TRANSFER_BYTES_MAX`]).
    pub transfer_bytes_max: usize,
    pub header_digest: bool,
    pub data_digest: bool,
    /// R2Ts the host accepts outstanding per command (ICReq MAXR2T + 1).
    pub r2t_outstanding_max: u32,
    pub connect_timeout: Duration,
    pub command_timeout: Duration,
}

/// Which way a command's data moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    None,
    ToController,
    FromController,
}

/// A read or write of many blocks that may be split into several commands, issued one after
/// another under the same command identifier.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LbaTransfer {
    pub write: bool,
    pub nsid: u32,
    pub lba: u64,
    pub lba_size_bytes: usize,
}

/// A finished command (or a finished split read or write): its tag, status, result dwords and
/// the data buffer it carried, moved back to the caller.
#[derive(Debug)]
pub struct Completion {
    /// The tag given at submission (the NVMe command identifier).
    pub tag: u16,
    /// The controller's status; success when the command (every part of a split one) succeeded.
    pub status: Status,
    /// Command specific result: DW0 in the low half, DW1 in the high half.
    pub result: u64,
    /// The buffer submitted with a read or write, filled for a read; `None` for other commands.
    pub buffer: Option<AlignedBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    InFlight,
    /// Finished and waiting in the ready queue: the tag is not reusable until it is handed out.
    Completed,
}

/// Per-command state, indexed by command identifier (= tag).
#[derive(Debug)]
struct Slot {
    state: SlotState,
    direction: Direction,
    buffer: Option<AlignedBuf>,
    /// Whether the buffer goes back to the caller with the completion (not for internal data
    /// such as Dataset Management ranges).
    return_buffer: bool,
    /// The bytes of `buffer` the current command moves: `window_start..window_start + window_len`.
    window_start: usize,
    window_len: usize,
    /// Total bytes of a split transfer; equals `window_len` for a single command.
    total_len: usize,
    lba_transfer: Option<LbaTransfer>,
    in_capsule: bool,
    /// C2H data received for the current command (data must arrive in order).
    received_bytes: usize,
    /// Next offset an R2T may ask for (R2Ts must ask for the data in order).
    r2t_next_offset: usize,
    /// A data digest mismatch fails the command with this status once it completes.
    transfer_error: Option<Status>,
}

impl Slot {
    fn free() -> Self {
        Slot {
            state: SlotState::Free,
            direction: Direction::None,
            buffer: None,
            return_buffer: false,
            window_start: 0,
            window_len: 0,
            total_len: 0,
            lba_transfer: None,
            in_capsule: false,
            received_bytes: 0,
            r2t_next_offset: 0,
            transfer_error: None,
        }
    }
}

/// What one submission carries besides its SQE.
#[derive(Debug)]
pub(crate) struct Submission {
    pub direction: Direction,
    pub buffer: Option<AlignedBuf>,
    /// Bytes of `buffer` to move (from its start).
    pub length: usize,
    pub return_buffer: bool,
    pub lba_transfer: Option<LbaTransfer>,
}

impl Submission {
    pub fn none() -> Self {
        Submission {
            direction: Direction::None,
            buffer: None,
            length: 0,
            return_buffer: false,
            lba_transfer: None,
        }
    }

    pub fn data(direction: Direction, buffer: AlignedBuf, return_buffer: bool) -> Self {
        let length = buffer.len();
        Submission { direction, buffer: Some(buffer), length, return_buffer, lba_transfer: None }
    }
}

pub(crate) struct QueuePair {
    stream: TcpStream,
    params: QueueParams,
    framing: Framing,
    /// MAXH2CDATA from ICResp: the most data in one H2CData PDU.
    maxh2cdata: usize,
    receive: Vec<u8>,
    receive_start: usize,
    receive_end: usize,
    send: Vec<u8>,
    send_offset: usize,
    slots: Vec<Slot>,
    /// Slots not free (in flight or completed and not yet handed out).
    busy: usize,
    ready: VecDeque<Completion>,
    /// Set by the first fatal error; every later call fails with it.
    broken: Option<String>,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("address", &self.params.address)
            .field("qid", &self.params.qid)
            .field("depth", &self.params.depth)
            .field("busy", &self.busy)
            .field("broken", &self.broken)
            .finish()
    }
}

impl QueuePair {
    /// Opens the TCP connection and runs ICReq/ICResp. The queue still needs a Fabrics Connect.
    pub async fn open(params: QueueParams) -> Result<QueuePair, InitiatorError> {
        assert!((1..=QUEUE_DEPTH_MAX).contains(&params.depth), "queue depth {}", params.depth);
        assert!(
            params.transfer_bytes_max > 0
                && params.transfer_bytes_max <= COMMAND_TRANSFER_BYTES_MAX
        );
        assert!(params.r2t_outstanding_max >= 1);
        let address = params.address;
        let stream =
            match tokio::time::timeout(params.connect_timeout, TcpStream::connect(address)).await {
                Err(_) => {
                    return Err(InitiatorError::Timeout {
                        address,
                        operation: "the TCP connect",
                        timeout_ms: duration_ms(params.connect_timeout),
                    })
                }
                Ok(Err(source)) if source.kind() == ErrorKind::ConnectionRefused => {
                    return Err(InitiatorError::ConnectRefused { address })
                }
                Ok(Err(source)) => return Err(InitiatorError::Connect { address, source }),
                Ok(Ok(stream)) => stream,
            };
        stream.set_nodelay(true).map_err(|source| InitiatorError::Connect { address, source })?;

        // The largest PDU the controller may send is C2HData with a whole command's data.
        let pdu_size_max = params.transfer_bytes_max + PDU_HEADER_BYTES_MAX + DIGEST_BYTES;
        let depth = usize::from(params.depth);
        let send_reserve = depth
            * (PDU_HEADER_BYTES_MAX
                + DIGEST_BYTES
                + params.in_capsule_bytes_max.min(SEND_RESERVE_DATA_BYTES_PER_COMMAND));
        let mut queue = QueuePair {
            stream,
            framing: Framing::new(Role::Host, pdu_size_max as u32),
            maxh2cdata: pdu::MAXH2CDATA_MIN as usize,
            receive: vec![0; pdu_size_max + RECEIVE_SLACK_BYTES],
            receive_start: 0,
            receive_end: 0,
            send: Vec::with_capacity(send_reserve),
            send_offset: 0,
            slots: (0..depth).map(|_| Slot::free()).collect(),
            busy: 0,
            ready: VecDeque::with_capacity(depth),
            broken: None,
            params,
        };
        queue.handshake().await?;
        Ok(queue)
    }

    async fn handshake(&mut self) -> Result<(), InitiatorError> {
        let requested = ICReq {
            pfv: PFV_1_0,
            hpda: 0,
            header_digest: self.params.header_digest,
            data_digest: self.params.data_digest,
            maxr2t: self.params.r2t_outstanding_max - 1,
        };
        encode_ic_req(&mut self.send, &requested);
        let deadline = tokio::time::Instant::now() + self.params.connect_timeout;
        let icresp = loop {
            let input = &self.receive[self.receive_start..self.receive_end];
            match pdu::decode(input, &self.framing) {
                Ok(Decoded::Incomplete { .. }) => {}
                Ok(Decoded::Pdu { pdu: Pdu::ICResp(icresp), consumed_bytes }) => {
                    self.receive_start += consumed_bytes;
                    break icresp;
                }
                Ok(Decoded::Pdu { pdu: Pdu::C2HTermReq(term), .. }) => {
                    return Err(self.terminated(term.fes, term.fei));
                }
                Ok(Decoded::Pdu { pdu, .. }) | Ok(Decoded::DataDigestMismatch { pdu, .. }) => {
                    let problem = format!("expected ICResp, received {:?}", pdu.pdu_type());
                    return Err(self.protocol(problem));
                }
                Err(source) => return Err(self.malformed(source)),
            }
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            self.wait_io("the ICReq (connection set-up)", remaining, self.params.connect_timeout)
                .await?;
        };
        let address = self.params.address;
        if icresp.pfv != PFV_1_0 {
            let problem = format!(
                "the controller answered with PDU format version {}; only 0 (1.0) is supported",
                icresp.pfv
            );
            return Err(InitiatorError::Unsupported { address, problem });
        }
        if (icresp.header_digest && !requested.header_digest)
            || (icresp.data_digest && !requested.data_digest)
        {
            return Err(
                self.protocol("ICResp enables a digest the host did not ask for".to_owned())
            );
        }
        self.framing = Framing {
            role: Role::Host,
            header_digest: icresp.header_digest,
            data_digest: icresp.data_digest,
            receive_pda: requested.hpda,
            send_pda: icresp.cpda,
            pdu_size_max: self.framing.pdu_size_max,
        };
        self.maxh2cdata = icresp.maxh2cdata as usize;
        tracing::debug!(%address, qid = self.params.qid, ?icresp, "NVMe/TCP connection initialized");
        Ok(())
    }

    pub fn params(&self) -> &QueueParams {
        &self.params
    }

    /// Commands submitted and not yet handed back.
    pub fn outstanding(&self) -> usize {
        self.busy
    }

    /// A tag no command holds, if any.
    pub fn free_tag(&self) -> Option<u16> {
        self.slots.iter().position(|slot| slot.state == SlotState::Free).map(|tag| tag as u16)
    }

    // --- Submission ---

    /// Records a command under `tag` and encodes it into the send buffer. Sends nothing.
    pub fn submit(
        &mut self,
        tag: u16,
        sqe: Sqe,
        submission: Submission,
    ) -> Result<(), InitiatorError> {
        self.check_usable()?;
        let depth = self.params.depth;
        let Some(slot) = self.slots.get_mut(usize::from(tag)) else {
            return Err(InitiatorError::InvalidRequest(format!(
                "tag {tag} is not below the queue depth {depth}"
            )));
        };
        if slot.state != SlotState::Free {
            return Err(InitiatorError::InvalidRequest(format!("tag {tag} is already in flight")));
        }
        let buffer_len = submission.buffer.as_ref().map_or(0, |buffer| buffer.len());
        assert!(
            submission.length <= buffer_len,
            "transfer of {} bytes from a {buffer_len}-byte buffer",
            submission.length
        );
        assert_eq!(
            submission.direction == Direction::None,
            submission.length == 0,
            "data direction and length disagree"
        );
        let window_len = submission.length.min(self.params.transfer_bytes_max);
        if window_len < submission.length && submission.lba_transfer.is_none() {
            // Only LBA transfers are split; anything else must fit in one command.
            return Err(InitiatorError::InvalidRequest(format!(
                "a {}-byte transfer is over this queue's {} bytes per command",
                submission.length, self.params.transfer_bytes_max
            )));
        }
        *slot = Slot {
            state: SlotState::InFlight,
            direction: submission.direction,
            buffer: submission.buffer,
            return_buffer: submission.return_buffer,
            window_start: 0,
            window_len,
            total_len: submission.length,
            lba_transfer: submission.lba_transfer,
            ..Slot::free()
        };
        self.busy += 1;
        self.encode_command(tag, sqe);
        Ok(())
    }

    /// Encodes the capsule of the slot's current command, with its SGL and in-capsule data.
    fn encode_command(&mut self, tag: u16, mut sqe: Sqe) {
        let in_capsule_bytes_max = self.params.in_capsule_bytes_max;
        let slot = &mut self.slots[usize::from(tag)];
        let length = slot.window_len;
        let window = slot.window_start..slot.window_start + length;
        sqe.set_cid(tag);
        let data: &[u8] = match (slot.direction, &slot.buffer) {
            (Direction::ToController, Some(buffer)) if length <= in_capsule_bytes_max => {
                slot.in_capsule = true;
                sqe.set_sgl(SglDescriptor::in_capsule(0, length as u32));
                &buffer[window]
            }
            _ => {
                slot.in_capsule = false;
                sqe.set_sgl(SglDescriptor::transport(length as u32));
                &[]
            }
        };
        encode_capsule_cmd(&mut self.send, &self.framing, &sqe, data);
    }

    // --- Completion ---

    /// Sends what is pending and returns the next completion, waiting for one if needed.
    pub async fn next_completion(
        &mut self,
        operation: &'static str,
    ) -> Result<Completion, InitiatorError> {
        self.check_usable()?;
        loop {
            self.try_flush().map_err(|error| self.latch(error))?;
            if let Some(completion) = self.ready.pop_front() {
                self.release(completion.tag);
                return Ok(completion);
            }
            if self.busy == 0 {
                return Err(InitiatorError::InvalidRequest(
                    "waiting for a completion with no command in flight".into(),
                ));
            }
            self.drive(operation).await?;
        }
    }

    /// Sends what is pending and returns the completion of `tag`, keeping others for later.
    pub async fn wait_for(
        &mut self,
        tag: u16,
        operation: &'static str,
    ) -> Result<Completion, InitiatorError> {
        self.check_usable()?;
        loop {
            self.try_flush().map_err(|error| self.latch(error))?;
            if let Some(index) = self.ready.iter().position(|completion| completion.tag == tag) {
                let completion = self.ready.remove(index).expect("the index was just found");
                self.release(tag);
                return Ok(completion);
            }
            assert_eq!(
                self.slots[usize::from(tag)].state,
                SlotState::InFlight,
                "waiting for tag {tag} not in flight"
            );
            self.drive(operation).await?;
        }
    }

    /// Runs one command to completion on a queue used one command at a time (the Fabrics
    /// Connect, before the admin queue's driver takes it over): completions nobody waits for any
    /// more (their waiter was cancelled) are dropped first.
    pub async fn execute(
        &mut self,
        sqe: Sqe,
        submission: Submission,
        operation: &'static str,
    ) -> Result<Completion, InitiatorError> {
        while let Some(orphan) = self.ready.pop_front() {
            self.release(orphan.tag);
        }
        let Some(tag) = self.free_tag() else {
            return Err(InitiatorError::InvalidRequest(format!(
                "all {} tags of queue {} are taken by commands that never completed",
                self.params.depth, self.params.qid
            )));
        };
        self.submit(tag, sqe, submission)?;
        self.wait_for(tag, operation).await
    }

    /// Moves what it can both ways and, if that completed nothing, waits for the socket (at most
    /// `timeout`, forever with `None`; a timeout is reported as `reported`) and processes what
    /// arrived. Completes nothing by itself:
    /// finished commands wait for [`QueuePair::take_completion`]. Cancel-safe, for a driver
    /// that keeps commands outstanding indefinitely (Asynchronous Event Requests) and selects
    /// between this and new submissions. Any error breaks the queue.
    pub async fn progress(
        &mut self,
        operation: &'static str,
        timeout: Option<Duration>,
        reported: Duration,
    ) -> Result<(), InitiatorError> {
        self.check_usable()?;
        let result = async {
            self.try_flush()?;
            self.process_received()?;
            if self.ready.is_empty() {
                self.wait_io_for(operation, timeout, reported).await?;
                self.process_received()?;
            }
            Ok(())
        }
        .await;
        result.map_err(|error| self.latch(error))
    }

    /// The oldest finished command, handed back (its tag is free again).
    pub fn take_completion(&mut self) -> Option<Completion> {
        let completion = self.ready.pop_front()?;
        self.release(completion.tag);
        Some(completion)
    }

    /// Makes closing the connection abortive: when the queue is dropped, the socket sends a TCP
    /// reset and discards what it has not sent yet, instead of delivering it after a FIN. For a
    /// queue given up on (a command timed out): commands still in the send buffer must never
    /// reach a controller that wakes up later. Bytes the controller's host already received
    /// cannot be recalled. Best effort: a socket that refuses the option closes normally.
    pub fn reset_on_drop(&self) {
        if let Err(error) = self.stream.set_zero_linger() {
            tracing::debug!(address = %self.params.address, %error, "cannot set SO_LINGER 0");
        }
    }

    /// Whether the queue failed and every call now fails, and why.
    pub fn broken_reason(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    fn release(&mut self, tag: u16) {
        let slot = &mut self.slots[usize::from(tag)];
        assert_eq!(slot.state, SlotState::Completed);
        *slot = Slot::free();
        self.busy -= 1;
    }

    /// Processes what was received; if that completed nothing, waits (bounded) for the socket and
    /// processes again. Any error breaks the queue.
    async fn drive(&mut self, operation: &'static str) -> Result<(), InitiatorError> {
        let result = async {
            self.process_received()?;
            if self.ready.is_empty() {
                let timeout = self.params.command_timeout;
                self.wait_io(operation, timeout, timeout).await?;
                self.process_received()?;
            }
            Ok(())
        }
        .await;
        result.map_err(|error| self.latch(error))
    }

    fn check_usable(&self) -> Result<(), InitiatorError> {
        match &self.broken {
            Some(reason) => Err(InitiatorError::QueueBroken {
                address: self.params.address,
                qid: self.params.qid,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Remembers a fatal error so that every later call fails with it.
    fn latch(&mut self, error: InitiatorError) -> InitiatorError {
        if !matches!(error, InitiatorError::InvalidRequest(_)) && self.broken.is_none() {
            self.broken = Some(error.to_string());
        }
        error
    }

    // --- Socket ---

    fn send_pending(&self) -> bool {
        self.send_offset < self.send.len()
    }

    /// Writes as much of the send buffer as the socket takes without waiting.
    fn try_flush(&mut self) -> Result<(), InitiatorError> {
        while self.send_pending() {
            match self.stream.try_write(&self.send[self.send_offset..]) {
                Ok(0) => return Err(self.closed("sending commands")),
                Ok(written) => self.send_offset += written,
                Err(error) if error.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(source) => return Err(self.io_error(source)),
            }
        }
        self.send.clear();
        self.send_offset = 0;
        Ok(())
    }

    /// Waits until the socket can take pending bytes or has bytes to give (at most `timeout`),
    /// then moves what it can both ways.
    async fn wait_io(
        &mut self,
        operation: &'static str,
        timeout: Duration,
        reported: Duration,
    ) -> Result<(), InitiatorError> {
        match tokio::time::timeout(timeout, self.wait_io_unbounded(operation)).await {
            Err(_) => Err(InitiatorError::Timeout {
                address: self.params.address,
                operation,
                timeout_ms: duration_ms(reported),
            }),
            Ok(result) => result,
        }
    }

    /// [`QueuePair::wait_io`] bounded by `timeout` when there is one, else waiting as long as
    /// the socket stays silent. Cancel-safe: nothing changes until the socket is ready.
    async fn wait_io_for(
        &mut self,
        operation: &'static str,
        timeout: Option<Duration>,
        reported: Duration,
    ) -> Result<(), InitiatorError> {
        match timeout {
            Some(timeout) => self.wait_io(operation, timeout, reported).await,
            None => self.wait_io_unbounded(operation).await,
        }
    }

    async fn wait_io_unbounded(&mut self, operation: &'static str) -> Result<(), InitiatorError> {
        self.try_flush()?;
        let interest = if self.send_pending() {
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        let ready = match self.stream.ready(interest).await {
            Err(source) => return Err(self.io_error(source)),
            Ok(ready) => ready,
        };
        if ready.is_writable() {
            self.try_flush()?;
        }
        if ready.is_readable() || ready.is_read_closed() {
            self.try_receive(operation)?;
        }
        Ok(())
    }

    /// Reads what the socket holds into the receive buffer without waiting.
    fn try_receive(&mut self, operation: &'static str) -> Result<(), InitiatorError> {
        if self.receive_start == self.receive_end {
            self.receive_start = 0;
            self.receive_end = 0;
        } else if self.receive.len() - self.receive_end < RECEIVE_SLACK_BYTES {
            // What is buffered is part of one PDU, at most pdu_size_max bytes: moving it to the
            // front leaves at least the slack free.
            self.receive.copy_within(self.receive_start..self.receive_end, 0);
            self.receive_end -= self.receive_start;
            self.receive_start = 0;
        }
        match self.stream.try_read(&mut self.receive[self.receive_end..]) {
            Ok(0) => Err(self.closed(operation)),
            Ok(read) => {
                self.receive_end += read;
                Ok(())
            }
            Err(error)
                if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) =>
            {
                Ok(())
            }
            Err(source) => Err(self.io_error(source)),
        }
    }

    // --- Received PDUs ---

    /// Handles every whole PDU in the receive buffer.
    fn process_received(&mut self) -> Result<(), InitiatorError> {
        loop {
            if self.receive_start == self.receive_end {
                return Ok(());
            }
            // The decoded PDU borrows the receive buffer while its handler changes the queue, so
            // the buffer is moved out for the call (a pointer swap, no copy).
            let receive = std::mem::take(&mut self.receive);
            let result = self.process_one(&receive[self.receive_start..self.receive_end]);
            self.receive = receive;
            match result? {
                Some(consumed_bytes) => self.receive_start += consumed_bytes,
                None => return Ok(()),
            }
        }
    }

    /// Handles the PDU at the start of `input`, returning its length, or `None` if it is not all
    /// there yet.
    fn process_one(&mut self, input: &[u8]) -> Result<Option<usize>, InitiatorError> {
        match pdu::decode(input, &self.framing) {
            Ok(Decoded::Incomplete { .. }) => Ok(None),
            Ok(Decoded::Pdu { pdu, consumed_bytes }) => {
                self.handle(pdu, false)?;
                Ok(Some(consumed_bytes))
            }
            Ok(Decoded::DataDigestMismatch { pdu, consumed_bytes, received, computed }) => {
                tracing::warn!(
                    address = %self.params.address, qid = self.params.qid, received, computed,
                    "data digest mismatch; failing the command"
                );
                self.handle(pdu, true)?;
                Ok(Some(consumed_bytes))
            }
            Err(source) => {
                // Tell the controller why before closing, as the transport asks; best effort.
                let mut term = Vec::new();
                let header = &input[..input.len().min(pdu::TERM_REQ_DATA_BYTES_MAX)];
                encode_term_req_for(&mut term, Role::Host, &source, header);
                let _ = self.stream.try_write(&term);
                Err(self.malformed(source))
            }
        }
    }

    fn handle(&mut self, pdu: Pdu<'_>, data_digest_bad: bool) -> Result<(), InitiatorError> {
        match pdu {
            Pdu::C2HData(header, data) => self.on_c2h_data(&header, data, data_digest_bad),
            _ if data_digest_bad => {
                Err(self.protocol(format!("data digest on a {:?} PDU", pdu.pdu_type())))
            }
            Pdu::CapsuleResp(cqe) => self.on_response(&cqe),
            Pdu::R2T(r2t) => self.on_r2t(&r2t),
            Pdu::C2HTermReq(term) => Err(self.terminated(term.fes, term.fei)),
            other => Err(self.protocol(format!("unexpected {:?} PDU", other.pdu_type()))),
        }
    }

    /// The in-flight slot of `cid`, or the protocol violation of naming another.
    fn in_flight_slot(&self, cid: u16, pdu_name: &str) -> Result<usize, InitiatorError> {
        let index = usize::from(cid);
        match self.slots.get(index) {
            Some(slot) if slot.state == SlotState::InFlight => Ok(index),
            _ => {
                Err(self
                    .protocol(format!("{pdu_name} for command id {cid}, which is not in flight")))
            }
        }
    }

    fn on_c2h_data(
        &mut self,
        header: &DataHeader,
        data: &[u8],
        data_digest_bad: bool,
    ) -> Result<(), InitiatorError> {
        let cid = header.cccid;
        let index = self.in_flight_slot(cid, "C2HData")?;
        let slot = &self.slots[index];
        let offset = header.datao as usize;
        let end = offset + data.len();
        let problem = if slot.direction != Direction::FromController {
            Some(format!("C2HData for command id {cid}, which reads no data"))
        } else if offset != slot.received_bytes {
            Some(format!(
                "C2HData for command id {cid} at offset {offset}, expected {}",
                slot.received_bytes
            ))
        } else if end > slot.window_len {
            Some(format!(
                "C2HData for command id {cid} ends at byte {end}, beyond its {} bytes",
                slot.window_len
            ))
        } else if header.last && end < slot.window_len {
            Some(format!(
                "last C2HData for command id {cid} ends at byte {end} of {}",
                slot.window_len
            ))
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(self.protocol(problem));
        }
        let slot = &mut self.slots[index];
        if data_digest_bad {
            slot.transfer_error = Some(Status::DATA_TRANSFER_ERROR);
        } else {
            let start = slot.window_start + offset;
            let buffer = slot.buffer.as_mut().expect("a command that reads data has a buffer");
            buffer[start..start + data.len()].copy_from_slice(data);
        }
        slot.received_bytes = end;
        if header.success {
            let status = slot.transfer_error.unwrap_or(Status::SUCCESS);
            self.complete(cid, status, 0);
        }
        Ok(())
    }

    fn on_response(&mut self, cqe: &Cqe) -> Result<(), InitiatorError> {
        let cid = cqe.cid;
        let index = self.in_flight_slot(cid, "CapsuleResp")?;
        let slot = &self.slots[index];
        let status = if cqe.status.is_success() {
            let incomplete = match slot.direction {
                Direction::FromController => slot.received_bytes < slot.window_len,
                Direction::ToController => {
                    !slot.in_capsule && slot.r2t_next_offset < slot.window_len
                }
                Direction::None => false,
            };
            if incomplete {
                return Err(self.protocol(format!(
                    "successful completion of command id {cid} before all its {} bytes of data moved",
                    slot.window_len
                )));
            }
            slot.transfer_error.unwrap_or(Status::SUCCESS)
        } else {
            cqe.status
        };
        self.complete(cid, status, cqe.result);
        Ok(())
    }

    fn on_r2t(&mut self, r2t: &R2T) -> Result<(), InitiatorError> {
        let cid = r2t.cccid;
        let index = self.in_flight_slot(cid, "R2T")?;
        let slot = &self.slots[index];
        let offset = r2t.r2to as usize;
        let end = offset + r2t.r2tl as usize;
        let problem = if slot.direction != Direction::ToController {
            Some(format!("R2T for command id {cid}, which sends no data"))
        } else if slot.in_capsule {
            Some(format!("R2T for command id {cid}, whose data was sent in the capsule"))
        } else if offset != slot.r2t_next_offset {
            Some(format!(
                "R2T for command id {cid} asks for offset {offset}, expected {}",
                slot.r2t_next_offset
            ))
        } else if end > slot.window_len {
            Some(format!(
                "R2T for command id {cid} asks for bytes {offset}..{end} of its {}",
                slot.window_len
            ))
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(self.protocol(problem));
        }
        let slot = &mut self.slots[index];
        slot.r2t_next_offset = end;
        let buffer = slot.buffer.as_ref().expect("a command that sends data has a buffer");
        let data = &buffer[slot.window_start + offset..slot.window_start + end];
        let chunk_count = data.len().div_ceil(self.maxh2cdata);
        for (chunk_index, chunk) in data.chunks(self.maxh2cdata).enumerate() {
            let header = DataHeader {
                cccid: cid,
                ttag: r2t.ttag,
                datao: (offset + chunk_index * self.maxh2cdata) as u32,
                datal: chunk.len() as u32,
                last: chunk_index + 1 == chunk_count,
                success: false,
            };
            encode_data_pdu(&mut self.send, &self.framing, &header, chunk);
        }
        Ok(())
    }

    /// Finishes the slot's current command: starts the next part of a split transfer, or moves
    /// the slot to the ready queue.
    fn complete(&mut self, cid: u16, status: Status, result: u64) {
        let slot = &mut self.slots[usize::from(cid)];
        let next_start = slot.window_start + slot.window_len;
        if status.is_success() && next_start < slot.total_len {
            let transfer = slot.lba_transfer.expect("only LBA transfers are split");
            slot.window_start = next_start;
            slot.window_len = (slot.total_len - next_start).min(self.params.transfer_bytes_max);
            slot.received_bytes = 0;
            slot.r2t_next_offset = 0;
            slot.transfer_error = None;
            let sqe = lba_sqe(cid, &transfer, slot.window_start, slot.window_len);
            self.encode_command(cid, sqe);
            return;
        }
        slot.state = SlotState::Completed;
        let buffer = slot.buffer.take().filter(|_| slot.return_buffer);
        self.ready.push_back(Completion { tag: cid, status, result, buffer });
        debug_assert!(self.ready.len() <= self.slots.len());
    }

    // --- Errors with this queue's context ---

    fn protocol(&self, problem: String) -> InitiatorError {
        InitiatorError::Protocol { address: self.params.address, qid: self.params.qid, problem }
    }

    fn malformed(&self, source: PduError) -> InitiatorError {
        InitiatorError::MalformedPdu { address: self.params.address, qid: self.params.qid, source }
    }

    fn terminated(&self, fes: u16, fei: u32) -> InitiatorError {
        InitiatorError::Terminated { address: self.params.address, qid: self.params.qid, fes, fei }
    }

    fn closed(&self, during: &'static str) -> InitiatorError {
        InitiatorError::ConnectionClosed {
            address: self.params.address,
            qid: self.params.qid,
            during,
        }
    }

    fn io_error(&self, source: std::io::Error) -> InitiatorError {
        InitiatorError::Io { address: self.params.address, qid: self.params.qid, source }
    }
}

/// The SQE of the part of a (possibly split) LBA transfer that moves `window_len` bytes from
/// `window_start`; both are whole blocks.
pub(crate) fn lba_sqe(
    tag: u16,
    transfer: &LbaTransfer,
    window_start: usize,
    window_len: usize,
) -> Sqe {
    debug_assert!(
        window_start % transfer.lba_size_bytes == 0 && window_len % transfer.lba_size_bytes == 0
    );
    let lba = transfer.lba + (window_start / transfer.lba_size_bytes) as u64;
    let blocks = (window_len / transfer.lba_size_bytes) as u32;
    if transfer.write {
        Sqe::write(tag, transfer.nsid, lba, blocks)
    } else {
        Sqe::read(tag, transfer.nsid, lba, blocks)
    }
}

pub(crate) fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use nvmf::command::{cns, csi, Status};
    use nvmf::pdu::{
        encode_capsule_resp, encode_ic_resp, encode_r2t, encode_term_req, FatalErrorStatus, ICResp,
    };
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    const SCRIPT_PDU_SIZE_MAX: u32 = 1 << 20;

    /// What the scripted controller answers to one PDU from the host.
    type Script = Box<dyn FnMut(Pdu<'_>, &Framing, &mut Vec<u8>) + Send>;

    /// A controller that answers ICReq with `icresp` and every later PDU with `script`.
    async fn scripted(icresp: ICResp, mut script: Script) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut framing = Framing::new(Role::Controller, SCRIPT_PDU_SIZE_MAX);
            let mut input = Vec::new();
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                let mut output = Vec::new();
                while let Ok(Decoded::Pdu { pdu, consumed_bytes }) = pdu::decode(&input, &framing) {
                    if let Pdu::ICReq(_) = pdu {
                        encode_ic_resp(&mut output, &icresp);
                        framing.header_digest = icresp.header_digest;
                        framing.data_digest = icresp.data_digest;
                    } else {
                        script(pdu, &framing, &mut output);
                    }
                    input.drain(..consumed_bytes);
                }
                if stream.write_all(&output).await.is_err() {
                    return;
                }
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(read) => input.extend_from_slice(&chunk[..read]),
                }
            }
        });
        address
    }

    fn plain_icresp() -> ICResp {
        ICResp { pfv: 0, cpda: 0, header_digest: false, data_digest: false, maxh2cdata: 4096 }
    }

    fn params(address: SocketAddr) -> QueueParams {
        QueueParams {
            address,
            qid: 1,
            depth: 4,
            in_capsule_bytes_max: 0,
            transfer_bytes_max: 64 * 1024,
            header_digest: false,
            data_digest: false,
            r2t_outstanding_max: 1,
            connect_timeout: Duration::from_secs(5),
            command_timeout: Duration::from_secs(5),
        }
    }

    fn buffer(length: usize) -> AlignedBuf {
        let mut buffer = AlignedBuf::new(length);
        buffer.set_len(length);
        buffer
    }

    fn respond(framing: &Framing, output: &mut Vec<u8>, cid: u16, status: Status) {
        encode_capsule_resp(output, framing, &Cqe { result: 0, sqhd: 0, sqid: 1, cid, status });
    }

    fn c2h(
        framing: &Framing,
        output: &mut Vec<u8>,
        cid: u16,
        datao: u32,
        data: &[u8],
        last: bool,
        success: bool,
    ) {
        let header =
            DataHeader { cccid: cid, ttag: 0, datao, datal: data.len() as u32, last, success };
        encode_data_pdu(output, framing, &header, data);
    }

    /// Runs one 4096-byte read (an Identify) against `script` and returns its outcome.
    async fn read_against(script: Script) -> Result<Completion, InitiatorError> {
        let address = scripted(plain_icresp(), script).await;
        let mut queue = QueuePair::open(params(address)).await?;
        let sqe = Sqe::identify(0, cns::CONTROLLER, 0, csi::NVM, 4096);
        queue.submit(2, sqe, Submission::data(Direction::FromController, buffer(4096), true))?;
        let result =
            tokio::time::timeout(Duration::from_secs(10), queue.next_completion("test")).await;
        result.expect("no hang")
    }

    fn expect_protocol(result: Result<Completion, InitiatorError>, needle: &str) {
        match result {
            Err(InitiatorError::Protocol { problem, .. }) => {
                assert!(problem.contains(needle), "{problem:?} lacks {needle:?}")
            }
            other => panic!("expected a protocol error about {needle:?}, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn c2h_data_is_checked_against_the_command() {
        let script = |mutate: fn(&mut DataHeader)| -> Script {
            Box::new(move |pdu, framing, output| {
                if let Pdu::CapsuleCmd(capsule) = pdu {
                    let mut header = DataHeader {
                        cccid: capsule.sqe.cid(),
                        ttag: 0,
                        datao: 0,
                        datal: 4096,
                        last: true,
                        success: false,
                    };
                    mutate(&mut header);
                    encode_data_pdu(output, framing, &header, &vec![7u8; header.datal as usize]);
                    respond(framing, output, capsule.sqe.cid(), Status::SUCCESS);
                }
            })
        };
        expect_protocol(
            read_against(script(|h| h.cccid = 3)).await,
            "C2HData for command id 3, which is not in flight",
        );
        expect_protocol(read_against(script(|h| h.cccid = 900)).await, "not in flight");
        expect_protocol(read_against(script(|h| h.datao = 512)).await, "at offset 512, expected 0");
        expect_protocol(read_against(script(|h| h.datal = 8192)).await, "beyond its 4096 bytes");
        expect_protocol(read_against(script(|h| h.datal = 1024)).await, "last C2HData");
        // Untouched: the read succeeds with the data.
        let completion = read_against(script(|_| {})).await.unwrap();
        assert_eq!(completion.tag, 2);
        assert!(completion.buffer.unwrap().iter().all(|byte| *byte == 7));
    }

    #[tokio::test]
    async fn success_flag_completes_without_a_response() {
        let completion = read_against(Box::new(|pdu, framing, output| {
            if let Pdu::CapsuleCmd(capsule) = pdu {
                let cid = capsule.sqe.cid();
                c2h(framing, output, cid, 0, &[1; 1000], false, false);
                c2h(framing, output, cid, 1000, &[2; 3096], true, true);
            }
        }))
        .await
        .unwrap();
        assert!(completion.status.is_success());
        let data = completion.buffer.unwrap();
        assert!(
            data[..1000].iter().all(|byte| *byte == 1)
                && data[1000..].iter().all(|byte| *byte == 2)
        );
    }

    #[tokio::test]
    async fn responses_and_r2t_are_checked() {
        expect_protocol(
            read_against(Box::new(|pdu, framing, output| {
                if let Pdu::CapsuleCmd(capsule) = pdu {
                    respond(framing, output, capsule.sqe.cid(), Status::SUCCESS);
                }
            }))
            .await,
            "before all its 4096 bytes of data moved",
        );
        expect_protocol(
            read_against(Box::new(|pdu, framing, output| {
                if let Pdu::CapsuleCmd(capsule) = pdu {
                    let r2t = R2T { cccid: capsule.sqe.cid(), ttag: 1, r2to: 0, r2tl: 4096 };
                    encode_r2t(output, framing, &r2t);
                }
            }))
            .await,
            "which sends no data",
        );
        // A failed command may complete without its data; it is not a protocol error.
        let completion = read_against(Box::new(|pdu, framing, output| {
            if let Pdu::CapsuleCmd(capsule) = pdu {
                respond(framing, output, capsule.sqe.cid(), Status::INVALID_FIELD);
            }
        }))
        .await
        .unwrap();
        assert_eq!(completion.status, Status::INVALID_FIELD);
    }

    #[tokio::test]
    async fn termination_and_garbage_end_the_queue() {
        let result = read_against(Box::new(|_, _, output| {
            encode_term_req(output, Role::Controller, FatalErrorStatus::HeaderDigestError, 0, &[]);
        }))
        .await;
        let error = result.unwrap_err();
        assert!(matches!(error, InitiatorError::Terminated { fes: 3, .. }), "{error}");
        assert!(error.to_string().contains("Header Digest Error"), "{error}");

        let result =
            read_against(Box::new(|_, _, output| output.extend_from_slice(&[0x42; 64]))).await;
        assert!(matches!(result, Err(InitiatorError::MalformedPdu { .. })), "{result:?}");
    }

    #[tokio::test]
    async fn write_data_follows_r2t_in_maxh2cdata_pieces() {
        let received = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&received);
        let address = scripted(
            plain_icresp(),
            Box::new(move |pdu, framing, output| match pdu {
                Pdu::CapsuleCmd(capsule) => {
                    assert!(capsule.data.is_empty(), "in-capsule data is off in this test");
                    let cid = capsule.sqe.cid();
                    // Two R2Ts, in order: 6000 bytes, then the remaining 4000.
                    encode_r2t(output, framing, &R2T { cccid: cid, ttag: 5, r2to: 0, r2tl: 6000 });
                    encode_r2t(
                        output,
                        framing,
                        &R2T { cccid: cid, ttag: 6, r2to: 6000, r2tl: 4000 },
                    );
                }
                Pdu::H2CData(header, data) => {
                    assert!(data.iter().all(|byte| *byte == 9));
                    seen.lock().unwrap().push((
                        header.ttag,
                        header.datao,
                        header.datal,
                        header.last,
                    ));
                    if header.datao + header.datal == 10_000 {
                        respond(framing, output, header.cccid, Status::SUCCESS);
                    }
                }
                other => panic!("unexpected {other:?}"),
            }),
        )
        .await;
        let mut queue = QueuePair::open(params(address)).await.unwrap();
        let mut data = buffer(10_000);
        data.fill(9);
        let sqe = Sqe::write(0, 1, 0, 1);
        queue.submit(0, sqe, Submission::data(Direction::ToController, data, true)).unwrap();
        let completion = queue.next_completion("test").await.unwrap();
        assert!(completion.status.is_success());
        assert_eq!(completion.buffer.unwrap().len(), 10_000);
        assert_eq!(
            *received.lock().unwrap(),
            [(5, 0, 4096, false), (5, 4096, 1904, true), (6, 6000, 4000, true)]
        );
    }

    #[tokio::test]
    async fn icresp_is_checked() {
        let icresp = ICResp { header_digest: true, ..plain_icresp() };
        let address = scripted(icresp, Box::new(|_, _, _| {})).await;
        let error = QueuePair::open(params(address)).await.unwrap_err();
        assert!(error.to_string().contains("digest the host did not ask for"), "{error}");

        let icresp = ICResp { pfv: 1, ..plain_icresp() };
        let address = scripted(icresp, Box::new(|_, _, _| {})).await;
        let error = QueuePair::open(params(address)).await.unwrap_err();
        assert!(matches!(error, InitiatorError::Unsupported { .. }), "{error}");
    }

    #[tokio::test]
    async fn a_silent_controller_times_out_and_breaks_the_queue() {
        let address = scripted(plain_icresp(), Box::new(|_, _, _| {})).await;
        let mut queue = QueuePair::open(QueueParams {
            command_timeout: Duration::from_millis(200),
            ..params(address)
        })
        .await
        .unwrap();
        queue.submit(0, Sqe::flush(0, 1), Submission::none()).unwrap();
        let error = queue.next_completion("a Flush").await.unwrap_err();
        assert!(
            error.to_string().contains("no answer from")
                && error.to_string().contains("to a Flush within 200 ms"),
            "{error}"
        );
        let error = queue.submit(1, Sqe::flush(1, 1), Submission::none()).unwrap_err();
        assert!(matches!(error, InitiatorError::QueueBroken { .. }), "{error}");
    }
}
