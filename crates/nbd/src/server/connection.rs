//! One NBD connection on the server side: the fixed newstyle handshake, then the transmission
//! phase, sans-IO.
//!
//! Hot path (transmission). The driver calls [`Connection::receive`] with the bytes it holds; the
//! connection takes what it can (partial headers and payloads are kept inside, so any split of
//! the stream works, down to one byte at a time) and returns how many bytes it used. It takes
//! less than it was given only when it must wait: the in-flight limits are reached, too much
//! output waits to be sent, or the connection is finishing. The driver keeps the rest and offers
//! it again after completing requests or sending output. Between calls the driver sends
//! [`Connection::output_chunks`], executes [`Connection::next_request`]s and hands each result
//! back with [`Connection::complete`].
//!
//! A read's data is sent from the buffer the driver filled, not copied into the output: the
//! output is the reply bytes with each read's buffer spliced in after its reply header, and the
//! driver sends its chunks in order with one vectored write.
//!
//! Every request holds one slot of a fixed table from the moment its header is admitted until
//! its completion: while its write data arrives, while it waits for the driver, and while the
//! driver has it. Data buffers come from a per-connection pool and travel with the requests.
//!
//! Errors follow the protocol. A request the server refuses (bad range, alignment, flags,
//! command, a write to a read-only export) gets an error reply, its write data is read and
//! dropped, and the connection goes on. A stream that cannot be parsed any more (a bad magic,
//! unknown client flags, an NBD_OPT_EXPORT_NAME that cannot be satisfied) ends the connection:
//! [`Connection::receive`] returns the [`ConnectionError`] and the driver closes the socket.

use std::collections::VecDeque;
use std::sync::Arc;

use types::{AlignedBuf, SpliceOutput};

use super::pool::BufferPool;
use super::{
    Catalog, ExportInfo, BLOCK_BYTES_MIN, BLOCK_SIZES, BUFFER_RETAINED_BYTES_MAX,
    EXPORTS_LISTED_MAX, HANDSHAKE_DEADLINE_MS, HANDSHAKE_FLAGS, INFLIGHT_PAYLOAD_BYTES_MAX,
    INFLIGHT_REQUESTS_MAX, OPTIONS_PER_CONNECTION_MAX, OPTION_DATA_BYTES_MAX,
    OUTPUT_PENDING_BYTES_MAX, PAYLOAD_BYTES_MAX,
};
use crate::wire::{
    self, chunk_flag, client_flag, command, command_flag, info, option, reply_type,
    transmission_flag, Errno, OptionHeader, RequestHeader, SimpleReply, CLIENT_FLAGS_BYTES,
    OPTION_HEADER_BYTES, REQUEST_HEADER_BYTES, STRING_BYTES_MAX,
};

const _: () = assert!(CLIENT_FLAGS_BYTES <= REQUEST_HEADER_BYTES);
const _: () = assert!(OPTION_HEADER_BYTES <= REQUEST_HEADER_BYTES);

/// Why a connection had to be closed. The driver logs it (at most at WARN: a client's mistake is
/// not the server's error) and closes the socket after sending [`Connection::output_chunks`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectionError {
    #[error(
        "the client sent unknown handshake flags {flags:#x} (only NBD_FLAG_C_FIXED_NEWSTYLE and \
         NBD_FLAG_C_NO_ZEROES exist); connection closed: check that the client speaks NBD"
    )]
    ClientFlagsUnknown { flags: u32 },
    #[error(
        "the client sent option magic {magic:#018x} instead of IHAVEOPT; connection closed: the \
         client does not speak newstyle NBD or lost track of the stream"
    )]
    OptionMagic { magic: u64 },
    #[error(
        "the client sent more than {OPTIONS_PER_CONNECTION_MAX} options without choosing an \
         export; connection closed"
    )]
    TooManyOptions,
    #[error(
        "NBD_OPT_EXPORT_NAME carried {length_bytes} bytes that are not an export name (UTF-8 \
         without NUL, at most 4096 bytes); connection closed, as that option cannot be refused"
    )]
    ExportNameInvalid { length_bytes: u32 },
    #[error(
        "NBD_OPT_EXPORT_NAME asked for export {name:?}, which does not exist; connection closed, \
         as that option cannot be refused: list the exports with `nbdinfo --list nbd://HOST:PORT`"
    )]
    ExportUnknown { name: String },
    #[error(
        "NBD_OPT_EXPORT_NAME asked for export {name:?}, which is not served over NBD: {reason}; \
         connection closed, as that option cannot be refused"
    )]
    ExportRefused { name: String, reason: String },
    #[error(
        "export {name:?} has {size_bytes} bytes, not a multiple of the {BLOCK_BYTES_MIN}-byte \
         block, so it cannot be served; connection closed: this is a server fault, report it"
    )]
    ExportSizeUnaligned { name: String, size_bytes: u64 },
    #[error(
        "the client sent request magic {magic:#010x} instead of {:#010x}; connection closed: the \
         client lost track of the stream or uses a request format that was not negotiated",
        wire::REQUEST_MAGIC
    )]
    RequestMagic { magic: u32 },
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Option haggling: no export chosen yet.
    Handshake,
    /// An export is chosen and requests flow.
    Transmission,
    /// The client sent NBD_CMD_DISC: requests already received are still served, nothing more
    /// is read, and [`Connection::wants_close`] turns true when none is left.
    Disconnecting,
    /// Finished (NBD_OPT_ABORT or a [`ConnectionError`]): send the output, then close.
    Closed,
}

/// Identifies a request until its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId {
    slot: u16,
    generation: u32,
}

/// What the driver must do for one request. Offsets and lengths are in bytes, multiples of
/// [`BLOCK_BYTES_MIN`], and lie within the export.
#[derive(Debug)]
pub enum RequestKind {
    /// Fill `buf` (its length is the read length) and hand it back with the completion.
    Read { offset: u64, buf: AlignedBuf },
    /// Write `data`; with `fua`, complete only once the data is durable. Hand `data` back with the
    /// completion so its buffer is reused.
    Write { offset: u64, data: AlignedBuf, fua: bool },
    /// Complete only once every write completed before it is durable.
    Flush,
    /// The range is no longer needed; it may be deallocated (it then reads as zeros).
    Trim { offset: u64, length_bytes: u32, fua: bool },
    /// The range must read as zeros; with `no_hole` it must stay allocated (no deallocation).
    WriteZeroes { offset: u64, length_bytes: u32, fua: bool, no_hole: bool },
}

/// A request for the driver's storage, on the export of this connection.
#[derive(Debug)]
pub struct Request {
    pub id: RequestId,
    /// The client's cookie (for logs; the connection echoes it in the reply).
    pub cookie: u64,
    pub kind: RequestKind,
}

/// A validated request, kept in its slot.
#[derive(Debug, Clone, Copy)]
enum Operation {
    Read { offset: u64, length_bytes: u32 },
    Write { offset: u64, fua: bool },
    Flush,
    Trim { offset: u64, length_bytes: u32, fua: bool },
    WriteZeroes { offset: u64, length_bytes: u32, fua: bool, no_hole: bool },
}

impl Operation {
    fn name(&self) -> &'static str {
        match self {
            Operation::Read { .. } => "read",
            Operation::Write { .. } => "write",
            Operation::Flush => "flush",
            Operation::Trim { .. } => "trim",
            Operation::WriteZeroes { .. } => "write zeroes",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// A write whose data is arriving.
    ReceivingPayload,
    /// Queued for `next_request`.
    Ready,
    /// With the driver.
    InStorage,
}

struct Slot {
    generation: u32,
    state: SlotState,
    cookie: u64,
    operation: Operation,
    /// Bytes this request counts against [`INFLIGHT_PAYLOAD_BYTES_MAX`].
    payload_bytes: u32,
    /// A write's data while it arrives and until `next_request`.
    buf: Option<AlignedBuf>,
}

/// What the connection expects next from the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Receiving {
    /// The 32-bit client flags that answer the greeting.
    ClientFlags,
    OptionHeader,
    /// Option data of `length` bytes (at most [`OPTION_DATA_BYTES_MAX`]), gathered whole.
    OptionData {
        option: u32,
        length: usize,
    },
    /// Data of an over-long option, dropped; then NBD_REP_ERR_TOO_BIG.
    OptionDiscard {
        option: u32,
        remaining: u32,
    },
    RequestHeader,
    /// A request header waits for a free slot or payload room.
    Admission(RequestHeader),
    /// The data of an admitted write.
    WritePayload {
        slot: u16,
        received: usize,
    },
    /// The data of a refused write, dropped.
    PayloadDiscard {
        remaining: u32,
    },
    /// Nothing more is read (after NBD_OPT_ABORT, NBD_CMD_DISC or an error).
    Nothing,
}

/// One NBD connection, server side. See the module documentation for how a driver uses it.
pub struct Connection {
    catalog: Arc<dyn Catalog>,
    created_ms: u64,
    phase: Phase,
    receiving: Receiving,
    /// The fixed-size message being received: client flags, option header or request header.
    header: [u8; REQUEST_HEADER_BYTES],
    header_bytes: usize,
    option_data: Vec<u8>,
    options_received: u32,
    client_no_zeroes: bool,
    structured_replies: bool,
    /// The export chosen by NBD_OPT_GO or NBD_OPT_EXPORT_NAME, and its transmission flags.
    export: Option<ExportInfo>,
    transmission_flags: u16,
    slots: Vec<Slot>,
    free_slots: Vec<u16>,
    ready: VecDeque<u16>,
    inflight_payload_bytes: u64,
    pool: BufferPool,
    /// Reply bytes, with each read's buffer spliced in after its reply header.
    output: SpliceOutput,
    failure: Option<ConnectionError>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("phase", &self.phase)
            .field("export", &self.export.as_ref().map(|export| &export.name))
            .field("structured_replies", &self.structured_replies)
            .field("inflight_requests", &self.inflight_requests())
            .field("failure", &self.failure)
            .finish()
    }
}

impl Connection {
    /// A connection accepted at `now_ms`; its output already holds the server greeting.
    pub fn new(catalog: Arc<dyn Catalog>, now_ms: u64) -> Connection {
        let slots = (0..INFLIGHT_REQUESTS_MAX)
            .map(|_| Slot {
                generation: 0,
                state: SlotState::Free,
                cookie: 0,
                operation: Operation::Flush,
                payload_bytes: 0,
                buf: None,
            })
            .collect();
        // Popped from the end: slot 0 is used first.
        let free_slots = (0..INFLIGHT_REQUESTS_MAX as u16).rev().collect();
        let mut output = SpliceOutput::new();
        wire::encode_greeting(output.bytes_mut(), HANDSHAKE_FLAGS);
        Connection {
            catalog,
            created_ms: now_ms,
            phase: Phase::Handshake,
            receiving: Receiving::ClientFlags,
            header: [0; REQUEST_HEADER_BYTES],
            header_bytes: 0,
            option_data: Vec::new(),
            options_received: 0,
            client_no_zeroes: false,
            structured_replies: false,
            export: None,
            transmission_flags: 0,
            slots,
            free_slots,
            ready: VecDeque::with_capacity(INFLIGHT_REQUESTS_MAX),
            inflight_payload_bytes: 0,
            pool: BufferPool::new(BUFFER_RETAINED_BYTES_MAX),
            output,
            failure: None,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The export chosen by the client, once the handshake is over.
    pub fn export(&self) -> Option<&ExportInfo> {
        self.export.as_ref()
    }

    /// The transmission flags sent for the chosen export, once the handshake is over.
    pub fn transmission_flags(&self) -> Option<u16> {
        self.export.as_ref().map(|_| self.transmission_flags)
    }

    /// Whether the client negotiated structured replies (NBD_OPT_STRUCTURED_REPLY).
    pub fn structured_replies(&self) -> bool {
        self.structured_replies
    }

    /// Requests admitted and not yet completed.
    pub fn inflight_requests(&self) -> usize {
        INFLIGHT_REQUESTS_MAX - self.free_slots.len()
    }

    /// Consumes bytes from the start of `input` and returns how many it took; the driver keeps
    /// the rest and offers it again (with more) after completing requests or sending output. An
    /// empty `input` is fine: it lets a request header that waited for room be admitted. On
    /// `Err` the connection is finished: send [`Connection::output_chunks`], then close.
    pub fn receive(&mut self, input: &[u8]) -> Result<usize, ConnectionError> {
        if let Some(failure) = &self.failure {
            return Err(failure.clone());
        }
        let mut consumed = 0;
        // Each pass consumes at least one byte or leaves the Admission state (which is entered
        // only by consuming a header's last byte), or stops; so the loop ends.
        loop {
            if self.output.len() > OUTPUT_PENDING_BYTES_MAX {
                break;
            }
            match self.step(&input[consumed..]) {
                Ok(Some(used)) => consumed += used,
                Ok(None) => break,
                Err(error) => {
                    self.fail(error.clone());
                    return Err(error);
                }
            }
        }
        Ok(consumed)
    }

    /// The bytes waiting to be sent, as chunks to send in this order (reply bytes and read
    /// buffers; none is empty). Input is refused while more than [`OUTPUT_PENDING_BYTES_MAX`]
    /// wait, and completions add at most the in-flight payload ([`INFLIGHT_PAYLOAD_BYTES_MAX`])
    /// and reply headers, so they stay bounded.
    pub fn output_chunks(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.output.chunks()
    }

    /// Bytes waiting to be sent: the sum of [`Connection::output_chunks`]' lengths.
    pub fn output_len(&self) -> usize {
        self.output.len()
    }

    /// Drops the first `length` bytes of [`Connection::output_chunks`], which the driver has
    /// sent; a read buffer sent whole goes back to the pool.
    pub fn consume_output(&mut self, length: usize) {
        self.output.consume(length);
        while let Some(buf) = self.output.take_released() {
            self.pool.give(buf);
        }
    }

    /// The next request for the driver, if any.
    pub fn next_request(&mut self) -> Option<Request> {
        let index = self.ready.pop_front()?;
        let slot = &mut self.slots[usize::from(index)];
        assert_eq!(slot.state, SlotState::Ready);
        slot.state = SlotState::InStorage;
        let kind = match slot.operation {
            Operation::Read { offset, length_bytes } => {
                RequestKind::Read { offset, buf: self.pool.take(length_bytes as usize) }
            }
            Operation::Write { offset, fua } => {
                let Some(data) = slot.buf.take() else {
                    unreachable!("a ready write holds its data")
                };
                RequestKind::Write { offset, data, fua }
            }
            Operation::Flush => RequestKind::Flush,
            Operation::Trim { offset, length_bytes, fua } => {
                RequestKind::Trim { offset, length_bytes, fua }
            }
            Operation::WriteZeroes { offset, length_bytes, fua, no_hole } => {
                RequestKind::WriteZeroes { offset, length_bytes, fua, no_hole }
            }
        };
        Some(Request {
            id: RequestId { slot: index, generation: slot.generation },
            cookie: slot.cookie,
            kind,
        })
    }

    /// Hands back the result of a request with its buffer: a successful Read must return its
    /// filled buffer; a Write should return its data buffer for reuse. Encodes the reply (simple
    /// or structured, as negotiated). After the connection closed it only recycles.
    pub fn complete(
        &mut self,
        id: RequestId,
        result: Result<(), Errno>,
        mut buf: Option<AlignedBuf>,
    ) {
        let index = usize::from(id.slot);
        let slot = &self.slots[index];
        assert!(
            slot.generation == id.generation && slot.state == SlotState::InStorage,
            "completion for a request that is not with the driver: {id:?}"
        );
        let (cookie, operation) = (slot.cookie, slot.operation);
        if self.phase != Phase::Closed {
            match (operation, result) {
                (Operation::Read { offset, length_bytes }, Ok(())) => {
                    let Some(data) = buf.take() else {
                        panic!("a read completed without its buffer: {id:?}");
                    };
                    assert_eq!(data.len(), length_bytes as usize, "read buffer length changed");
                    let bytes = self.output.bytes_mut();
                    if self.structured_replies {
                        let flags = chunk_flag::DONE;
                        wire::encode_offset_data_header(bytes, flags, cookie, offset, length_bytes);
                    } else {
                        SimpleReply { error: 0, cookie }.encode(bytes);
                    }
                    // Sent from the driver's buffer after the header, not copied (an empty
                    // buffer has no piece and goes back to the pool at once).
                    let whole = (!data.is_empty()).then_some(0..data.len());
                    self.output.push_buffer(data, whole.into_iter(), |_, _, _, _| {});
                }
                (_, Ok(())) => SimpleReply { error: 0, cookie }.encode(self.output.bytes_mut()),
                (operation, Err(errno)) => {
                    let message = format!("{} failed: {errno}", operation.name());
                    self.reply_error(cookie, errno, &message);
                }
            }
        }
        if let Some(buf) = buf {
            self.pool.give(buf);
        }
        self.free_slot(index);
    }

    /// Whether the connection should be closed once its output is sent: after NBD_OPT_ABORT or
    /// a [`ConnectionError`], or after NBD_CMD_DISC once no request is left. Requests still with
    /// the driver when a connection closes may be dropped with it.
    pub fn wants_close(&self) -> bool {
        match self.phase {
            Phase::Closed => true,
            Phase::Disconnecting => self.inflight_requests() == 0,
            Phase::Handshake | Phase::Transmission => false,
        }
    }

    /// Whether the client has failed to choose an export within [`HANDSHAKE_DEADLINE_MS`] of
    /// being accepted; the driver then closes the connection.
    pub fn handshake_expired(&self, now_ms: u64) -> bool {
        self.phase == Phase::Handshake
            && now_ms.saturating_sub(self.created_ms) > HANDSHAKE_DEADLINE_MS
    }

    /// Ends the connection: drops queued requests and their buffers (requests with the driver
    /// still complete, into the void).
    fn fail(&mut self, error: ConnectionError) {
        if let Receiving::WritePayload { slot, .. } = self.receiving {
            self.free_slot(usize::from(slot));
        }
        while let Some(index) = self.ready.pop_front() {
            self.free_slot(usize::from(index));
        }
        self.failure = Some(error);
        self.phase = Phase::Closed;
        self.receiving = Receiving::Nothing;
    }

    /// One step of receiving: `Some(bytes used)`, or None when nothing more can be done now.
    fn step(&mut self, rest: &[u8]) -> Result<Option<usize>, ConnectionError> {
        match self.receiving {
            Receiving::ClientFlags => {
                let Some(used) = self.fill_header(rest, CLIENT_FLAGS_BYTES) else {
                    return Ok(None);
                };
                if self.header_bytes == CLIENT_FLAGS_BYTES {
                    self.header_bytes = 0;
                    self.on_client_flags()?;
                }
                Ok(Some(used))
            }
            Receiving::OptionHeader => {
                let Some(used) = self.fill_header(rest, OPTION_HEADER_BYTES) else {
                    return Ok(None);
                };
                if self.header_bytes == OPTION_HEADER_BYTES {
                    self.header_bytes = 0;
                    self.on_option_header()?;
                }
                Ok(Some(used))
            }
            Receiving::OptionData { option, length } => {
                if rest.is_empty() {
                    return Ok(None);
                }
                let used = (length - self.option_data.len()).min(rest.len());
                self.option_data.extend_from_slice(&rest[..used]);
                if self.option_data.len() == length {
                    let data = std::mem::take(&mut self.option_data);
                    self.receiving = Receiving::OptionHeader;
                    let handled = self.on_option(option, &data);
                    if self.phase == Phase::Handshake {
                        // Kept for the next option; after the handshake it is freed.
                        self.option_data = data;
                        self.option_data.clear();
                    }
                    handled?;
                }
                Ok(Some(used))
            }
            Receiving::OptionDiscard { option, remaining } => {
                if rest.is_empty() {
                    return Ok(None);
                }
                let used = (remaining as usize).min(rest.len());
                let remaining = remaining - used as u32;
                if remaining == 0 {
                    self.receiving = Receiving::OptionHeader;
                    let message = format!(
                        "option data over {OPTION_DATA_BYTES_MAX} bytes is refused by this server"
                    );
                    self.option_reply(option, reply_type::ERR_TOO_BIG, message.as_bytes());
                } else {
                    self.receiving = Receiving::OptionDiscard { option, remaining };
                }
                Ok(Some(used))
            }
            Receiving::RequestHeader => {
                let Some(used) = self.fill_header(rest, REQUEST_HEADER_BYTES) else {
                    return Ok(None);
                };
                if self.header_bytes == REQUEST_HEADER_BYTES {
                    self.header_bytes = 0;
                    let bytes: [u8; REQUEST_HEADER_BYTES] = self.header;
                    let header = RequestHeader::decode(&bytes)
                        .map_err(|bad| ConnectionError::RequestMagic { magic: bad.found as u32 })?;
                    self.receiving = Receiving::Admission(header);
                }
                Ok(Some(used))
            }
            Receiving::Admission(header) => {
                if !self.can_admit(&header) {
                    return Ok(None);
                }
                self.receiving = Receiving::RequestHeader;
                self.on_request(header);
                Ok(Some(0))
            }
            Receiving::WritePayload { slot, received } => {
                if rest.is_empty() {
                    return Ok(None);
                }
                let entry = &mut self.slots[usize::from(slot)];
                let Some(buf) = entry.buf.as_mut() else {
                    unreachable!("a write receiving its data holds a buffer")
                };
                let used = (buf.len() - received).min(rest.len());
                buf[received..received + used].copy_from_slice(&rest[..used]);
                let received = received + used;
                if received == buf.len() {
                    entry.state = SlotState::Ready;
                    self.ready.push_back(slot);
                    self.receiving = Receiving::RequestHeader;
                } else {
                    self.receiving = Receiving::WritePayload { slot, received };
                }
                Ok(Some(used))
            }
            Receiving::PayloadDiscard { remaining } => {
                if rest.is_empty() {
                    return Ok(None);
                }
                let used = (remaining as usize).min(rest.len());
                let remaining = remaining - used as u32;
                self.receiving = if remaining == 0 {
                    Receiving::RequestHeader
                } else {
                    Receiving::PayloadDiscard { remaining }
                };
                Ok(Some(used))
            }
            Receiving::Nothing => Ok(None),
        }
    }

    /// Copies bytes of a fixed-size message into `header` until it holds `size` bytes. None if
    /// `rest` is empty.
    fn fill_header(&mut self, rest: &[u8], size: usize) -> Option<usize> {
        if rest.is_empty() {
            return None;
        }
        let used = (size - self.header_bytes).min(rest.len());
        self.header[self.header_bytes..self.header_bytes + used].copy_from_slice(&rest[..used]);
        self.header_bytes += used;
        Some(used)
    }

    fn header_array<const N: usize>(&self) -> [u8; N] {
        std::array::from_fn(|index| self.header[index])
    }

    // ----- Handshake -----

    fn on_client_flags(&mut self) -> Result<(), ConnectionError> {
        let flags = u32::from_be_bytes(self.header_array());
        if flags & !client_flag::KNOWN != 0 {
            return Err(ConnectionError::ClientFlagsUnknown { flags });
        }
        // A client without NBD_FLAG_C_FIXED_NEWSTYLE is served as fixed newstyle all the same
        // (the protocol allows it): such a client sends only NBD_OPT_EXPORT_NAME, which has the
        // same answer in both.
        self.client_no_zeroes = flags & client_flag::C_NO_ZEROES != 0;
        self.receiving = Receiving::OptionHeader;
        Ok(())
    }

    fn on_option_header(&mut self) -> Result<(), ConnectionError> {
        let header = OptionHeader::decode(&self.header_array())
            .map_err(|bad| ConnectionError::OptionMagic { magic: bad.found })?;
        self.options_received += 1;
        if self.options_received > OPTIONS_PER_CONNECTION_MAX {
            return Err(ConnectionError::TooManyOptions);
        }
        if header.length > OPTION_DATA_BYTES_MAX {
            if header.option == option::EXPORT_NAME {
                return Err(ConnectionError::ExportNameInvalid { length_bytes: header.length });
            }
            self.receiving =
                Receiving::OptionDiscard { option: header.option, remaining: header.length };
        } else if header.length == 0 {
            self.receiving = Receiving::OptionHeader;
            self.on_option(header.option, &[])?;
        } else {
            self.receiving =
                Receiving::OptionData { option: header.option, length: header.length as usize };
        }
        Ok(())
    }

    /// Answers one whole option. On entry `receiving` is `OptionHeader`; options that end the
    /// handshake change it.
    fn on_option(&mut self, code: u32, data: &[u8]) -> Result<(), ConnectionError> {
        match code {
            option::EXPORT_NAME => self.on_export_name(data)?,
            option::ABORT => {
                // Any data is ignored, as the protocol asks.
                self.option_reply(code, reply_type::ACK, &[]);
                self.phase = Phase::Closed;
                self.receiving = Receiving::Nothing;
            }
            option::LIST => self.on_list(data),
            option::INFO | option::GO => self.on_info_or_go(code, data),
            option::STRUCTURED_REPLY => {
                if data.is_empty() {
                    self.structured_replies = true;
                    self.option_reply(code, reply_type::ACK, &[]);
                } else {
                    self.option_reply(
                        code,
                        reply_type::ERR_INVALID,
                        b"NBD_OPT_STRUCTURED_REPLY takes no data",
                    );
                }
            }
            option::STARTTLS => self.option_reply(
                code,
                reply_type::ERR_UNSUP,
                b"this server does not support TLS; connect without TLS",
            ),
            option::LIST_META_CONTEXT | option::SET_META_CONTEXT => self.option_reply(
                code,
                reply_type::ERR_UNSUP,
                b"this server has no metadata contexts (no NBD_CMD_BLOCK_STATUS)",
            ),
            other => {
                let message = format!("option {other} is not supported by this server");
                self.option_reply(other, reply_type::ERR_UNSUP, message.as_bytes());
            }
        }
        Ok(())
    }

    fn on_export_name(&mut self, data: &[u8]) -> Result<(), ConnectionError> {
        let Some(name) = parse_name(data) else {
            return Err(ConnectionError::ExportNameInvalid { length_bytes: data.len() as u32 });
        };
        let Some(export) = self.catalog.lookup(name) else {
            return Err(match self.catalog.refusal(name) {
                Some(reason) => ConnectionError::ExportRefused { name: name.to_owned(), reason },
                None => ConnectionError::ExportUnknown { name: name.to_owned() },
            });
        };
        if export.size_bytes % u64::from(BLOCK_BYTES_MIN) != 0 {
            return Err(ConnectionError::ExportSizeUnaligned {
                name: export.name,
                size_bytes: export.size_bytes,
            });
        }
        let flags = self.flags_for(&export);
        wire::encode_export_name_reply(
            self.output.bytes_mut(),
            export.size_bytes,
            flags,
            !self.client_no_zeroes,
        );
        self.enter_transmission(export, flags);
        Ok(())
    }

    fn on_list(&mut self, data: &[u8]) {
        if !data.is_empty() {
            self.option_reply(option::LIST, reply_type::ERR_INVALID, b"NBD_OPT_LIST takes no data");
            return;
        }
        let exports = self.catalog.list();
        let listable = exports.iter().filter(|export| parse_name(export.name.as_bytes()).is_some());
        for export in listable.take(EXPORTS_LISTED_MAX) {
            let description = wire::truncate_str(&export.description, STRING_BYTES_MAX);
            wire::encode_rep_server(self.output.bytes_mut(), &export.name, description);
        }
        self.option_reply(option::LIST, reply_type::ACK, &[]);
    }

    fn on_info_or_go(&mut self, code: u32, data: &[u8]) {
        let Some((name, info_requests)) = parse_info_request(data) else {
            self.option_reply(
                code,
                reply_type::ERR_INVALID,
                b"malformed data: expected a 32-bit name length, the name (UTF-8 without NUL), \
                  a 16-bit count and that many 16-bit information types",
            );
            return;
        };
        let Some(export) = self.catalog.lookup(name) else {
            if let Some(reason) = self.catalog.refusal(name) {
                let message = wire::truncate_str(&reason, STRING_BYTES_MAX);
                self.option_reply(code, reply_type::ERR_POLICY, message.as_bytes());
                return;
            }
            let message = format!(
                "no export named {:?}; NBD_OPT_LIST (nbdinfo --list) shows the exports",
                wire::truncate_str(name, 256)
            );
            self.option_reply(code, reply_type::ERR_UNKNOWN, message.as_bytes());
            return;
        };
        if export.size_bytes % u64::from(BLOCK_BYTES_MIN) != 0 {
            let message = format!(
                "export {:?} cannot be served: its size is not a multiple of {BLOCK_BYTES_MIN} \
                 bytes (a server fault; report it)",
                wire::truncate_str(&export.name, 256)
            );
            self.option_reply(code, reply_type::ERR_UNKNOWN, message.as_bytes());
            return;
        }
        let flags = self.flags_for(&export);
        let requested = |wanted: u16| {
            info_requests
                .chunks_exact(2)
                .any(|pair| u16::from_be_bytes([pair[0], pair[1]]) == wanted)
        };
        wire::encode_info_export(self.output.bytes_mut(), code, export.size_bytes, flags);
        if requested(info::NAME) {
            let name = wire::truncate_str(&export.name, STRING_BYTES_MAX);
            wire::encode_info_text(self.output.bytes_mut(), code, info::NAME, name);
        }
        if requested(info::DESCRIPTION) && !export.description.is_empty() {
            let description = wire::truncate_str(&export.description, STRING_BYTES_MAX);
            wire::encode_info_text(self.output.bytes_mut(), code, info::DESCRIPTION, description);
        }
        // Sent whether asked or not: the server enforces non-default constraints (a 4 KiB
        // minimum block), which the protocol says it must advertise.
        wire::encode_info_block_size(self.output.bytes_mut(), code, BLOCK_SIZES);
        self.option_reply(code, reply_type::ACK, &[]);
        if code == option::GO {
            self.enter_transmission(export, flags);
        }
    }

    fn flags_for(&self, export: &ExportInfo) -> u16 {
        use transmission_flag::*;
        let mut flags = HAS_FLAGS | SEND_FLUSH | CAN_MULTI_CONN;
        if export.read_only {
            flags |= READ_ONLY;
        } else {
            flags |= SEND_FUA | SEND_TRIM | SEND_WRITE_ZEROES;
        }
        // A read is always answered with a single content chunk, so "don't fragment" holds.
        if self.structured_replies {
            flags |= SEND_DF;
        }
        flags
    }

    fn enter_transmission(&mut self, export: ExportInfo, flags: u16) {
        self.export = Some(export);
        self.transmission_flags = flags;
        self.phase = Phase::Transmission;
        self.receiving = Receiving::RequestHeader;
        self.option_data = Vec::new();
    }

    fn option_reply(&mut self, code: u32, reply: u32, payload: &[u8]) {
        wire::encode_option_reply(self.output.bytes_mut(), code, reply, payload);
    }

    // ----- Transmission -----

    /// Whether a request with this header can take a slot now; refused requests are checked the
    /// same way, which only delays them.
    fn can_admit(&self, header: &RequestHeader) -> bool {
        !self.free_slots.is_empty()
            && self.inflight_payload_bytes + u64::from(payload_bytes(header))
                <= INFLIGHT_PAYLOAD_BYTES_MAX
    }

    fn on_request(&mut self, header: RequestHeader) {
        if header.command == command::DISC {
            // Requests already received are still served; nothing after this is read.
            self.phase = Phase::Disconnecting;
            self.receiving = Receiving::Nothing;
            return;
        }
        match self.validate(&header) {
            Ok(operation) => {
                let Some(index) = self.free_slots.pop() else {
                    unreachable!("admission checked for a free slot")
                };
                let payload_bytes = payload_bytes(&header);
                self.inflight_payload_bytes += u64::from(payload_bytes);
                let buf = match operation {
                    Operation::Write { .. } => Some(self.pool.take(header.length as usize)),
                    _ => None,
                };
                let is_write = buf.is_some();
                let slot = &mut self.slots[usize::from(index)];
                assert_eq!(slot.state, SlotState::Free);
                slot.cookie = header.cookie;
                slot.operation = operation;
                slot.payload_bytes = payload_bytes;
                slot.buf = buf;
                if is_write {
                    slot.state = SlotState::ReceivingPayload;
                    self.receiving = Receiving::WritePayload { slot: index, received: 0 };
                } else {
                    slot.state = SlotState::Ready;
                    self.ready.push_back(index);
                }
            }
            Err((errno, message)) => {
                self.reply_error(header.cookie, errno, &message);
                if header.command == command::WRITE && header.length > 0 {
                    self.receiving = Receiving::PayloadDiscard { remaining: header.length };
                }
            }
        }
    }

    /// Checks a request against the export and the protocol, in the order the protocol's error
    /// rules suggest: command, flags, permission, length, alignment, size limit, range.
    fn validate(&self, header: &RequestHeader) -> Result<Operation, (Errno, String)> {
        let structured_only = if self.structured_replies { command_flag::DF } else { 0 };
        let (name, allowed_flags) = match header.command {
            command::READ => ("READ", command_flag::FUA | structured_only),
            command::WRITE => ("WRITE", command_flag::FUA),
            command::FLUSH => ("FLUSH", command_flag::FUA),
            command::TRIM => ("TRIM", command_flag::FUA),
            command::WRITE_ZEROES => ("WRITE_ZEROES", command_flag::FUA | command_flag::NO_HOLE),
            other => {
                return Err((
                    Errno::Invalid,
                    format!(
                        "command {other} is not supported; this server implements READ, WRITE, \
                         DISC, FLUSH, TRIM and WRITE_ZEROES"
                    ),
                ))
            }
        };
        if header.flags & !allowed_flags != 0 {
            return Err((
                Errno::Invalid,
                format!(
                    "command flags {:#x} are not valid for {name} (allowed: {allowed_flags:#x})",
                    header.flags
                ),
            ));
        }
        let fua = header.flags & command_flag::FUA != 0;
        let (offset, length_bytes) = (header.offset, header.length);
        if header.command == command::FLUSH {
            if offset != 0 || length_bytes != 0 {
                return Err((Errno::Invalid, "FLUSH must have offset 0 and length 0".to_owned()));
            }
            return Ok(Operation::Flush);
        }
        let Some(export) = self.export.as_ref() else {
            unreachable!("requests are parsed only in transmission, which has an export")
        };
        let writes = header.command != command::READ;
        if writes && export.read_only {
            return Err((Errno::Perm, format!("export {:?} is read-only", export.name)));
        }
        if length_bytes == 0 {
            return Err((Errno::Invalid, format!("{name} of length 0")));
        }
        let block = u64::from(BLOCK_BYTES_MIN);
        if offset % block != 0 || u64::from(length_bytes) % block != 0 {
            return Err((
                Errno::Invalid,
                format!(
                    "{name} at offset {offset} of length {length_bytes}: both must be multiples \
                     of the {BLOCK_BYTES_MIN}-byte minimum block size"
                ),
            ));
        }
        if length_bytes > PAYLOAD_BYTES_MAX {
            match header.command {
                command::READ => {
                    return Err((
                        Errno::Overflow,
                        format!("READ of {length_bytes} bytes is over the {PAYLOAD_BYTES_MAX}-byte maximum payload"),
                    ))
                }
                command::WRITE => {
                    return Err((
                        Errno::Invalid,
                        format!("WRITE of {length_bytes} bytes is over the {PAYLOAD_BYTES_MAX}-byte maximum payload"),
                    ))
                }
                // TRIM and WRITE_ZEROES carry no payload: any 32-bit length is served.
                _ => {}
            }
        }
        let in_range =
            offset.checked_add(u64::from(length_bytes)).is_some_and(|end| end <= export.size_bytes);
        if !in_range {
            // The protocol's errors: ENOSPC for writes past the end, EINVAL for reads and trims.
            let errno = match header.command {
                command::WRITE | command::WRITE_ZEROES => Errno::NoSpace,
                _ => Errno::Invalid,
            };
            return Err((
                errno,
                format!(
                    "{name} at offset {offset} of length {length_bytes} goes past the end of \
                     export {:?} ({} bytes)",
                    export.name, export.size_bytes
                ),
            ));
        }
        Ok(match header.command {
            command::READ => Operation::Read { offset, length_bytes },
            command::WRITE => Operation::Write { offset, fua },
            command::TRIM => Operation::Trim { offset, length_bytes, fua },
            _ => Operation::WriteZeroes {
                offset,
                length_bytes,
                fua,
                no_hole: header.flags & command_flag::NO_HOLE != 0,
            },
        })
    }

    /// An error reply: a structured NBD_REPLY_TYPE_ERROR chunk with a message if structured
    /// replies were negotiated, else a simple reply (without data, even for a read).
    fn reply_error(&mut self, cookie: u64, errno: Errno, message: &str) {
        if self.structured_replies {
            wire::encode_error_chunk(
                self.output.bytes_mut(),
                chunk_flag::DONE,
                cookie,
                errno,
                message,
            );
        } else {
            SimpleReply { error: errno.code(), cookie }.encode(self.output.bytes_mut());
        }
    }

    fn free_slot(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        assert_ne!(slot.state, SlotState::Free, "slot {index} freed twice");
        slot.state = SlotState::Free;
        slot.generation = slot.generation.wrapping_add(1);
        if let Some(buf) = slot.buf.take() {
            self.pool.give(buf);
        }
        self.inflight_payload_bytes -= u64::from(slot.payload_bytes);
        self.free_slots.push(index as u16);
    }
}

/// The data bytes a request holds while in flight: its write data or its read buffer. Requests
/// that will be refused for their size hold none.
fn payload_bytes(header: &RequestHeader) -> u32 {
    match header.command {
        command::READ | command::WRITE if header.length <= PAYLOAD_BYTES_MAX => header.length,
        _ => 0,
    }
}

/// An export name: UTF-8 without NUL, at most [`STRING_BYTES_MAX`] bytes.
fn parse_name(bytes: &[u8]) -> Option<&str> {
    if bytes.len() > STRING_BYTES_MAX || bytes.contains(&0) {
        return None;
    }
    std::str::from_utf8(bytes).ok()
}

/// The data of NBD_OPT_INFO and NBD_OPT_GO: name length u32, name, count u16, count info types
/// u16 (returned as their raw bytes). None if the lengths do not add up exactly.
fn parse_info_request(data: &[u8]) -> Option<(&str, &[u8])> {
    let name_length = usize::try_from(wire::read_u32(data, 0)?).ok()?;
    let name_end = 4usize.checked_add(name_length)?;
    let name = parse_name(data.get(4..name_end)?)?;
    let count = usize::from(wire::read_u16(data, name_end)?);
    let requests = data.get(name_end + 2..)?;
    (requests.len() == count * 2).then_some((name, requests))
}
