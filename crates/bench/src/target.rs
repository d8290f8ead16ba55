//! What `ferrite bench` needs from a block target, as two small traits, so the benchmark engine
//! does not depend on any one transport.
//!
//! The NVMe/TCP initiator implements [`Connector`] (opens I/O queues) and [`BlockQueue`] (one
//! pipelined I/O queue); tests implement them over RAM. The shape follows an NVMe queue pair:
//! the bench puts commands in with [`BlockQueue::submit`], which does not wait, and takes
//! completions out, in any order, with [`BlockQueue::next_completion`]. Buffers are owned and
//! moved, never copied or allocated per I/O: the bench hands a buffer over with each request and
//! gets the same buffer back with its completion.
//!
//! # Contract, for implementors
//!
//! * One queue is driven by one task: `&mut self` everywhere, no `Send` needed. The bench runs
//!   all its queues in one task on a current-thread tokio runtime (the machine's other cores are
//!   for the server). A queue may spawn its own helper tasks if it likes (`spawn_local`).
//! * `submit` must not wait on the network. It records the request (for NVMe/TCP: encodes the
//!   command capsule into the queue's send buffer) and returns. Requests submitted before a call
//!   to `next_completion` must be sent by that call at the latest: `next_completion` is where
//!   the queue flushes its send buffer *and* reads the socket, both at once, so the two
//!   directions can never deadlock on full TCP windows. Batching several submits into one
//!   `write` is encouraged.
//! * At most `queue_depth` requests (the value given to [`Connector::connect`]) are in flight per
//!   queue. Each in-flight request has a distinct `tag` in `0..queue_depth`; a tag is reused only
//!   after its completion was returned. An NVMe/TCP queue can use the tag as the command
//!   identifier (CID) directly, with no lookup table.
//! * `offset_bytes` and `buffer.len()` are multiples of [`IO_ALIGNMENT_BYTES`];
//!   `buffer.len()` is between 4 KiB and [`IO_SIZE_BYTES_MAX`], and the range lies inside
//!   [`BlockQueue::size_bytes`]. A read fills `buffer[..len]`; a write sends `buffer[..len]`. An
//!   implementation whose controller has a smaller maximum transfer (MDTS) splits internally.
//! * Every submitted request produces exactly one [`IoCompletion`] carrying the same `tag` and
//!   the same buffer (same allocation, same length). A command the target failed (an NVMe status
//!   other than success) is a completion with [`IoStatus::Failed`], not an `Err`.
//! * `Err` from `submit` or `next_completion` means the queue is broken (connection lost,
//!   protocol violation, keep-alive timeout): the bench stops and drops every queue. Buffers of
//!   requests still in flight are dropped with the queue.
//! * `next_completion` is only called while at least one request is in flight. Its future is
//!   awaited to the end, except when another queue of the run failed: then it is dropped mid-wait
//!   and the queue itself is dropped right after, so it needs no cancel-safety beyond not
//!   panicking.
//! * A successful write completion means the data is durable (Ferrite reports no volatile write
//!   cache), so the bench's verifier treats it as the block's new content.

use std::error::Error;
use std::future::Future;

pub use types::AlignedBuf;

/// Offsets and lengths of every request are multiples of this: the Ferrite block size.
pub const IO_ALIGNMENT_BYTES: u32 = types::BLOCK_SIZE_BYTES;
/// The largest request the bench submits (the `--fill` and read-back I/O size).
pub const IO_SIZE_BYTES_MAX: u32 = 128 * 1024;

const _: () = assert!(IO_SIZE_BYTES_MAX % IO_ALIGNMENT_BYTES == 0);

/// Whether a request reads from the target into the buffer or writes the buffer to the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
}

/// One I/O command handed to a queue. Moving it moves the buffer's handle, not its bytes.
#[derive(Debug)]
pub struct IoRequest {
    /// Distinct among this queue's in-flight requests, below the queue depth.
    pub tag: u16,
    pub kind: IoKind,
    /// Byte offset into the namespace; a multiple of [`IO_ALIGNMENT_BYTES`].
    pub offset_bytes: u64,
    /// The data to write, or the space to read into; its `len()` is the transfer length.
    pub buffer: AlignedBuf,
}

/// How the target answered one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoStatus {
    Success,
    /// The target completed the command with an error. For NVMe, `status_code` is the 15-bit
    /// Status Field of the completion queue entry (dword 3 bits 31:17, shifted down): SC in bits
    /// 7:0, SCT in 10:8, then CRD, More and Do Not Retry.
    Failed {
        status_code: u16,
    },
}

/// The answer to one [`IoRequest`]: its tag, its buffer back (filled, for a read) and the status.
#[derive(Debug)]
pub struct IoCompletion {
    pub tag: u16,
    pub buffer: AlignedBuf,
    pub status: IoStatus,
}

/// One pipelined I/O queue to a block namespace (for NVMe/TCP: one I/O queue pair on its own TCP
/// connection). See the module documentation for the full contract.
pub trait BlockQueue {
    /// A broken queue: the connection or the protocol failed. Per-command failures are not errors
    /// but [`IoStatus::Failed`] completions.
    type Error: Error + Send + Sync + 'static;

    /// The namespace's size in bytes (from Identify Namespace: NSZE times the LBA data size). The
    /// same on every queue of one connection.
    fn size_bytes(&self) -> u64;

    /// Queues one request without waiting. The request goes out on the wire no later than the
    /// next call to [`BlockQueue::next_completion`].
    fn submit(&mut self, request: IoRequest) -> Result<(), Self::Error>;

    /// Sends what `submit` queued, then waits for any one in-flight request to complete and
    /// returns it. Completions come in whatever order the target finishes them.
    fn next_completion(&mut self) -> impl Future<Output = Result<IoCompletion, Self::Error>>;
}

/// Opens I/O queues to one target (for NVMe/TCP: connects the admin queue, identifies the
/// namespace, then connects `queue_count` I/O queues).
pub trait Connector {
    type Queue: BlockQueue;
    type Error: Error + Send + Sync + 'static;

    /// Opens exactly `queue_count` queues, each able to hold `queue_depth` requests in flight.
    /// Called once per bench run (and once per [`crate::VerifyMap::check_all`]); the queues are
    /// dropped when the run ends, which closes them.
    fn connect(
        &mut self,
        queue_count: u16,
        queue_depth: u16,
    ) -> impl Future<Output = Result<Vec<Self::Queue>, Self::Error>>;
}
