//! An NVMe I/O queue on its own TCP connection, with two ways to use it: a pipelined
//! submit/poll API for the benchmark (up to `depth` commands in flight, tags chosen by the
//! caller and used as command identifiers), and simple awaiting calls for tests (`read`,
//! `write`, `flush`, `write_zeroes`, `deallocate`).
//!
//! Hot path (the submit and completion calls). Reads and writes longer than the controller's
//! transfer limit (MDTS) are split into commands issued one after another under the same tag, so
//! the caller sees one request and one completion with its buffer, whatever the limit.

use std::sync::Arc;

use nvmf::command::{DsmRange, Sqe, DSM_RANGES_MAX, DSM_RANGE_BYTES};
use types::AlignedBuf;

use crate::controller::{Namespace, Shared};
use crate::error::InitiatorError;
use crate::queue::{lba_sqe, Completion, Direction, LbaTransfer, QueuePair, Submission};

/// Most blocks one Write Zeroes command covers (NLB is 16 bits, 0's based).
pub const WRITE_ZEROES_BLOCKS_MAX: u32 = 1 << 16;

/// A range of logical blocks, for Dataset Management (deallocate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbaRange {
    pub lba: u64,
    pub blocks: u32,
}

/// One I/O queue pair. Not shared between tasks: every call takes `&mut self`.
#[derive(Debug)]
pub struct IoQueue {
    queue: QueuePair,
    namespace: Namespace,
    /// Keeps the admin queue and its keep-alive running while this queue lives.
    controller: Arc<Shared>,
}

impl IoQueue {
    pub(crate) fn new(queue: QueuePair, namespace: Namespace, controller: Arc<Shared>) -> IoQueue {
        IoQueue { queue, namespace, controller }
    }

    pub fn qid(&self) -> u16 {
        self.queue.params().qid
    }

    /// Commands this queue holds in flight at most; tags are `0..depth`.
    pub fn depth(&self) -> u16 {
        self.queue.params().depth
    }

    /// The namespace as it was when the queue opened.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// The namespace's size in bytes as its controller last identified it (namespace attribute
    /// notices update it).
    pub fn size_bytes(&self) -> u64 {
        self.controller
            .current_namespace()
            .filter(|namespace| namespace.nsid == self.namespace.nsid)
            .map_or(self.namespace.size_bytes(), |namespace| namespace.size_bytes())
    }

    /// The controller ID this queue belongs to.
    pub fn cntlid(&self) -> u16 {
        self.controller.cntlid
    }

    /// Largest data of one command on this queue; longer reads and writes are split.
    pub fn transfer_bytes_max(&self) -> usize {
        self.queue.params().transfer_bytes_max
    }

    /// Largest write sent inside the command capsule; longer writes go by R2T.
    pub fn in_capsule_bytes_max(&self) -> usize {
        self.queue.params().in_capsule_bytes_max
    }

    /// Closes the queue's connection with a TCP reset, discarding commands not yet sent (see
    /// `QueuePair::reset_on_drop`): for a queue whose commands timed out, so that none of them
    /// is delivered later.
    pub fn abort(self) {
        self.queue.reset_on_drop();
    }

    /// Requests submitted whose completion has not been handed back yet.
    pub fn outstanding(&self) -> usize {
        self.queue.outstanding()
    }

    // --- Pipelined API ---

    /// Queues a read of `buffer.len()` bytes from `lba` under `tag`. Sends nothing yet.
    pub fn submit_read(
        &mut self,
        tag: u16,
        lba: u64,
        buffer: AlignedBuf,
    ) -> Result<(), InitiatorError> {
        self.submit_lba(tag, lba, buffer, false)
    }

    /// Queues a write of `buffer` to `lba` under `tag`. Sends nothing yet.
    pub fn submit_write(
        &mut self,
        tag: u16,
        lba: u64,
        buffer: AlignedBuf,
    ) -> Result<(), InitiatorError> {
        self.submit_lba(tag, lba, buffer, true)
    }

    fn submit_lba(
        &mut self,
        tag: u16,
        lba: u64,
        buffer: AlignedBuf,
        write: bool,
    ) -> Result<(), InitiatorError> {
        let lba_size_bytes = self.namespace.lba_size_bytes as usize;
        let length = buffer.len();
        if length == 0 || length % lba_size_bytes != 0 {
            return Err(InitiatorError::InvalidRequest(format!(
                "a {length}-byte {} is not a whole number of {lba_size_bytes}-byte blocks",
                if write { "write" } else { "read" }
            )));
        }
        let transfer = LbaTransfer { write, nsid: self.namespace.nsid, lba, lba_size_bytes };
        let sqe = lba_sqe(tag, &transfer, 0, length.min(self.transfer_bytes_max()));
        let direction = if write { Direction::ToController } else { Direction::FromController };
        let submission = Submission {
            direction,
            buffer: Some(buffer),
            length,
            return_buffer: true,
            lba_transfer: Some(transfer),
        };
        self.queue.submit(tag, sqe, submission)
    }

    /// Queues a Flush under `tag`.
    pub fn submit_flush(&mut self, tag: u16) -> Result<(), InitiatorError> {
        self.queue.submit(tag, Sqe::flush(tag, self.namespace.nsid), Submission::none())
    }

    /// Queues a Write Zeroes of `blocks` (1 to [`WRITE_ZEROES_BLOCKS_MAX`]) from `lba`.
    pub fn submit_write_zeroes(
        &mut self,
        tag: u16,
        lba: u64,
        blocks: u32,
    ) -> Result<(), InitiatorError> {
        if !(1..=WRITE_ZEROES_BLOCKS_MAX).contains(&blocks) {
            return Err(InitiatorError::InvalidRequest(format!(
                "Write Zeroes of {blocks} blocks: one command covers 1 to {WRITE_ZEROES_BLOCKS_MAX}"
            )));
        }
        let sqe = Sqe::write_zeroes(tag, self.namespace.nsid, lba, blocks, false);
        self.queue.submit(tag, sqe, Submission::none())
    }

    /// Queues a Dataset Management deallocate of `ranges` (1 to 256). Not for the hot path: it
    /// allocates the range list.
    pub fn submit_deallocate(
        &mut self,
        tag: u16,
        ranges: &[LbaRange],
    ) -> Result<(), InitiatorError> {
        if ranges.is_empty() || ranges.len() > DSM_RANGES_MAX {
            return Err(InitiatorError::InvalidRequest(format!(
                "deallocate of {} ranges: one command takes 1 to {DSM_RANGES_MAX}",
                ranges.len()
            )));
        }
        let length = ranges.len() * DSM_RANGE_BYTES;
        let mut buffer = AlignedBuf::new(length);
        buffer.set_len(length);
        for (range, bytes) in ranges.iter().zip(buffer.chunks_exact_mut(DSM_RANGE_BYTES)) {
            let encoded =
                DsmRange { context_attributes: 0, blocks: range.blocks, slba: range.lba }.encode();
            bytes.copy_from_slice(&encoded);
        }
        let sqe = Sqe::dataset_management(tag, self.namespace.nsid, ranges.len() as u32, true);
        self.queue.submit(tag, sqe, Submission::data(Direction::ToController, buffer, false))
    }

    /// Sends what was submitted and returns the next completion, in the order the controller
    /// finishes commands. Cancel-safe. An `Err` means the queue is broken; a command the
    /// controller failed is an `Ok` completion with its status.
    pub async fn next_completion(&mut self) -> Result<Completion, InitiatorError> {
        self.queue.next_completion("an I/O command").await
    }

    // --- Simple API: one command at a time, each awaited ---

    /// Reads `buffer.len()` bytes from `lba` into `buffer` and returns it.
    pub async fn read(
        &mut self,
        lba: u64,
        buffer: AlignedBuf,
    ) -> Result<AlignedBuf, InitiatorError> {
        let tag = self.free_tag()?;
        self.submit_read(tag, lba, buffer)?;
        let completion = self.wait(tag, "Read").await?;
        Ok(completion.buffer.expect("a read returns its buffer"))
    }

    /// Writes `buffer` to `lba` and returns the buffer once the write is complete (durable on
    /// Ferrite, which has no volatile write cache).
    pub async fn write(
        &mut self,
        lba: u64,
        buffer: AlignedBuf,
    ) -> Result<AlignedBuf, InitiatorError> {
        let tag = self.free_tag()?;
        self.submit_write(tag, lba, buffer)?;
        let completion = self.wait(tag, "Write").await?;
        Ok(completion.buffer.expect("a write returns its buffer"))
    }

    pub async fn flush(&mut self) -> Result<(), InitiatorError> {
        let tag = self.free_tag()?;
        self.submit_flush(tag)?;
        self.wait(tag, "Flush").await.map(drop)
    }

    /// Zeroes `blocks` blocks from `lba`, in commands of at most [`WRITE_ZEROES_BLOCKS_MAX`].
    pub async fn write_zeroes(&mut self, lba: u64, blocks: u64) -> Result<(), InitiatorError> {
        let mut done = 0;
        while done < blocks {
            let count = (blocks - done).min(u64::from(WRITE_ZEROES_BLOCKS_MAX)) as u32;
            let tag = self.free_tag()?;
            self.submit_write_zeroes(tag, lba + done, count)?;
            self.wait(tag, "Write Zeroes").await?;
            done += u64::from(count);
        }
        Ok(())
    }

    /// Deallocates `ranges` (1 to 256): they read back as zeros afterwards on Ferrite.
    pub async fn deallocate(&mut self, ranges: &[LbaRange]) -> Result<(), InitiatorError> {
        let tag = self.free_tag()?;
        self.submit_deallocate(tag, ranges)?;
        self.wait(tag, "Dataset Management (deallocate)").await.map(drop)
    }

    fn free_tag(&self) -> Result<u16, InitiatorError> {
        self.queue.free_tag().ok_or_else(|| {
            InitiatorError::InvalidRequest(format!(
                "all {} tags of I/O queue {} are in flight",
                self.depth(),
                self.qid()
            ))
        })
    }

    async fn wait(
        &mut self,
        tag: u16,
        command: &'static str,
    ) -> Result<Completion, InitiatorError> {
        let completion = self.queue.wait_for(tag, "an I/O command").await?;
        if completion.status.is_success() {
            Ok(completion)
        } else {
            Err(InitiatorError::CommandFailed {
                address: self.controller.address,
                command,
                status: completion.status,
            })
        }
    }
}
