//! NVM I/O commands: Read, Write, Flush, Write Zeroes and Dataset Management (deallocate).
//!
//! Hot path. Each command is checked (namespace, transfer size, LBA range, data descriptor)
//! and then either completes at once with an error status or takes a slot and a pooled buffer
//! and becomes a storage request, after its write data has arrived in the capsule or by R2T.

use super::queue::{HostData, Outcome, Queue, SlotCommand, SlotState};
use super::TRANSFER_BYTES_MAX;
use crate::command::{
    io_opcode, Sqe, Status, DSM_ATTRIBUTE_DEALLOCATE, DSM_RANGES_MAX, DSM_RANGE_BYTES,
    FABRICS_OPCODE, NSID_ALL,
};

/// The only namespace of every subsystem.
const NSID: u32 = 1;

impl Queue {
    /// A command on a connected I/O queue.
    pub(super) fn execute_io(&mut self, sqe: Sqe, data: &[u8]) -> Outcome {
        if sqe.opcode() == FABRICS_OPCODE {
            return self.execute_io_fabrics(sqe);
        }
        let Some(controller) = self.controller.as_ref() else {
            return Outcome::rejected(Status::COMMAND_SEQUENCE_ERROR);
        };
        if !controller.ready() {
            return Outcome::rejected(Status::COMMAND_SEQUENCE_ERROR);
        }
        if sqe.fuse() != 0 {
            return Outcome::rejected(Status::INVALID_FIELD);
        }
        let accesses_namespace = matches!(
            sqe.opcode(),
            io_opcode::READ
                | io_opcode::WRITE
                | io_opcode::FLUSH
                | io_opcode::WRITE_ZEROES
                | io_opcode::DATASET_MANAGEMENT
        );
        if accesses_namespace {
            // One atomic load: the path's ANA state, set by the node through the target.
            if let Some(status) = controller.ana().io_status() {
                // Path related, without DNR: the host retries on another path.
                return Outcome::Complete { status, result: 0 };
            }
        }
        let writes = matches!(sqe.opcode(), io_opcode::WRITE | io_opcode::WRITE_ZEROES)
            || (sqe.opcode() == io_opcode::DATASET_MANAGEMENT
                && sqe.cdw(11) & DSM_ATTRIBUTE_DEALLOCATE != 0);
        if writes && self.namespace.as_ref().is_some_and(|namespace| namespace.read_only) {
            return Outcome::rejected(Status::NAMESPACE_WRITE_PROTECTED.with_dnr());
        }
        let result = match sqe.opcode() {
            io_opcode::READ => self.read(&sqe),
            io_opcode::WRITE => self.write(&sqe, data),
            io_opcode::FLUSH => self.flush(&sqe),
            io_opcode::WRITE_ZEROES => self.write_zeroes(&sqe),
            io_opcode::DATASET_MANAGEMENT => self.dataset_management(&sqe, data),
            _ => Err(Status::INVALID_OPCODE),
        };
        Outcome::settle(result)
    }

    /// Checks the namespace and LBA range of a Read, Write or Write Zeroes and returns the start,
    /// block count and data length in bytes.
    fn check_lba_range(&self, sqe: &Sqe, transfers_data: bool) -> Result<(u64, u32, u64), Status> {
        let namespace = self.namespace.as_ref().ok_or(Status::INVALID_NAMESPACE_OR_FORMAT)?;
        if sqe.nsid() != NSID {
            return Err(Status::INVALID_NAMESPACE_OR_FORMAT);
        }
        let (lba, blocks) = (sqe.slba(), sqe.block_count());
        let length_bytes = u64::from(blocks) * u64::from(namespace.block_size_bytes);
        if transfers_data && length_bytes > u64::from(TRANSFER_BYTES_MAX) {
            return Err(Status::INVALID_FIELD);
        }
        match lba.checked_add(u64::from(blocks)) {
            Some(end) if end <= namespace.size_blocks() => Ok((lba, blocks, length_bytes)),
            _ => Err(Status::LBA_OUT_OF_RANGE),
        }
    }

    fn read(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        let (lba, blocks, length) = self.check_lba_range(sqe, true)?;
        if u64::from(Queue::controller_to_host_length(sqe)?) != length {
            return Err(Status::DATA_SGL_LENGTH_INVALID);
        }
        let buf = self.pool.take(length as usize);
        self.allocate_slot(
            sqe.cid(),
            SlotCommand::Read { lba, blocks },
            length as u32,
            Some(buf),
            SlotState::Ready,
        );
        Ok(Outcome::Deferred)
    }

    fn write(&mut self, sqe: &Sqe, capsule_data: &[u8]) -> Result<Outcome, Status> {
        let (lba, blocks, length) = self.check_lba_range(sqe, true)?;
        let command = SlotCommand::Write { lba, blocks };
        match Queue::host_data(sqe, capsule_data)? {
            HostData::InCapsule(data) => {
                if data.len() as u64 != length {
                    return Err(Status::DATA_SGL_LENGTH_INVALID);
                }
                let mut buf = self.pool.take(data.len());
                buf.copy_from_slice(data);
                self.allocate_slot(sqe.cid(), command, length as u32, Some(buf), SlotState::Ready);
            }
            HostData::Transport(sgl_length) => {
                if u64::from(sgl_length) != length {
                    return Err(Status::DATA_SGL_LENGTH_INVALID);
                }
                let buf = self.pool.take(length as usize);
                let index = self.allocate_slot(
                    sqe.cid(),
                    command,
                    sgl_length,
                    Some(buf),
                    SlotState::ReceivingData,
                );
                self.send_r2t(index);
            }
        }
        Ok(Outcome::Deferred)
    }

    fn flush(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        if self.namespace.is_none() || (sqe.nsid() != NSID && sqe.nsid() != NSID_ALL) {
            return Err(Status::INVALID_NAMESPACE_OR_FORMAT);
        }
        self.allocate_slot(sqe.cid(), SlotCommand::Flush, 0, None, SlotState::Ready);
        Ok(Outcome::Deferred)
    }

    fn write_zeroes(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        let (lba, blocks, _) = self.check_lba_range(sqe, false)?;
        self.allocate_slot(
            sqe.cid(),
            SlotCommand::WriteZeroes { lba, blocks },
            0,
            None,
            SlotState::Ready,
        );
        Ok(Outcome::Deferred)
    }

    fn dataset_management(&mut self, sqe: &Sqe, capsule_data: &[u8]) -> Result<Outcome, Status> {
        if self.namespace.is_none() || sqe.nsid() != NSID {
            return Err(Status::INVALID_NAMESPACE_OR_FORMAT);
        }
        let ranges = (sqe.cdw(10) & 0xFF) as usize + 1;
        let deallocate = sqe.cdw(11) & DSM_ATTRIBUTE_DEALLOCATE != 0;
        let ranges_bytes = ranges * DSM_RANGE_BYTES;
        let host_data = Queue::host_data(sqe, capsule_data)?;
        let sgl_length = match host_data {
            HostData::InCapsule(data) => data.len(),
            HostData::Transport(length) => length as usize,
        };
        if sgl_length < ranges_bytes || sgl_length > DSM_RANGES_MAX * DSM_RANGE_BYTES {
            return Err(Status::DATA_SGL_LENGTH_INVALID);
        }
        if !deallocate {
            // Only the deallocate attribute asks for work; the others are hints.
            return Ok(Outcome::success(0));
        }
        let command = SlotCommand::Deallocate { ranges: ranges as u16 };
        match host_data {
            HostData::InCapsule(data) => {
                let mut buf = self.pool.take(ranges_bytes);
                buf.copy_from_slice(&data[..ranges_bytes]);
                let index = self.allocate_slot(
                    sqe.cid(),
                    command,
                    ranges_bytes as u32,
                    Some(buf),
                    SlotState::ReceivingData,
                );
                self.data_received(index, 0);
            }
            HostData::Transport(length) => {
                let buf = self.pool.take(length as usize);
                let index = self.allocate_slot(
                    sqe.cid(),
                    command,
                    length,
                    Some(buf),
                    SlotState::ReceivingData,
                );
                self.send_r2t(index);
            }
        }
        Ok(Outcome::Deferred)
    }
}
