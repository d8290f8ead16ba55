//! The messages nodes exchange about one volume. Every one carries the sender's epoch, which
//! is what fences a deposed primary: a node refuses anything older than the newest epoch it has
//! seen and answers `Stale` with its own.
//!
//! This module defines them as values; [`crate::wire`] encodes them as checksummed frames
//! (docs/replication-wire.md), each in an [`Envelope`] that names the volume and the sender, and
//! the transport must deliver each message whole (no partial delivery). Loss, duplication, delay
//! and reordering are all tolerated.

use std::ops::Range;

use crate::{BlockData, NodeId, StreamId, BLOCKS_PER_OP_MAX, DEALLOCATE_BLOCKS_PER_OP_MAX};

/// What a stream entry does on the replica: both write `blocks` at `lba`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    /// A host write, numbered `op` in the primary's epoch.
    Write { op: u64 },
    /// A copy of the primary's current blocks (resync or reconciliation). Its data reflects
    /// host writes up to `covers_op`; 0 when every write it reflects had completed.
    Copy { covers_op: u64 },
}

/// One entry of a stream: blocks to write at `lba`, applied in stream order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: EntryKind,
    pub lba: u64,
    pub blocks: Vec<BlockData>,
}

impl Entry {
    /// The newest host write this entry's data may reflect (0: only completed ones).
    pub fn covers_op(&self) -> u64 {
        match self.kind {
            EntryKind::Write { op } => op,
            EntryKind::Copy { covers_op } => covers_op,
        }
    }

    /// The LBAs the entry writes.
    pub fn lbas(&self) -> std::ops::Range<u64> {
        self.lba..self.lba + self.blocks.len() as u64
    }

    /// Whether the entry holds as many blocks as the protocol allows: 1 to `BLOCKS_PER_OP_MAX`,
    /// or to `DEALLOCATE_BLOCKS_PER_OP_MAX` when every block is unmapped (a deallocate carries
    /// no data).
    pub fn length_valid(&self) -> bool {
        let count = self.blocks.len();
        let max = if self.blocks.iter().all(Option::is_none) {
            DEALLOCATE_BLOCKS_PER_OP_MAX
        } else {
            BLOCKS_PER_OP_MAX
        };
        (1..=max as usize).contains(&count)
    }
}

/// The LBAs a replica may hold differently from the other in-sync replicas: those written by
/// entries not yet known to be committed (after a restart, those its write intent persisted).
/// `Unknown` after an overflow, or a restart without a known intent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DivergenceReport {
    /// LBA ranges, canonical: sorted, none empty, none overlapping or touching the next (see
    /// [`merge_ranges`]). The wire sends a list that is not canonical as `Unknown`.
    Known(Vec<Range<u64>>),
    Unknown,
}

/// Sorts LBA ranges and merges those that overlap or touch, dropping empty ones: the canonical
/// form of a set of LBAs that [`DivergenceReport::Known`] and the write intent carry.
pub fn merge_ranges(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.retain(|range| !range.is_empty());
    ranges.sort_unstable_by_key(|range| range.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for range in ranges {
        match merged.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    merged
}

/// Whether `ranges` is canonical: what [`merge_ranges`] returns for it.
pub fn ranges_canonical(ranges: &[Range<u64>]) -> bool {
    ranges.iter().all(|range| range.start < range.end)
        && ranges.windows(2).all(|pair| pair[0].end < pair[1].start)
}

/// A message about the volume between two nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Primary to replica: entry `seq` of `stream` (sequence numbers start at 1 and have no
    /// gaps). `incarnation` is the replica process the stream was opened for; `commit_op`
    /// says every host write up to it is on every in-sync replica.
    Append {
        epoch: u64,
        stream: StreamId,
        incarnation: u64,
        seq: u64,
        commit_op: u64,
        entry: Entry,
    },
    /// Primary to replica, periodically on every stream: liveness and the commit point.
    Heartbeat { epoch: u64, stream: StreamId, incarnation: u64, commit_op: u64 },
    /// Replica to primary: every entry of `stream` up to `durable_seq` is durable here.
    Ack { epoch: u64, stream: StreamId, durable_seq: u64 },
    /// New primary to in-sync replica: adopt `epoch` and report your divergence.
    Probe { epoch: u64 },
    /// Reply to `Probe`, sent once `epoch` is durable on the replica. `volume_blocks` is the
    /// volume's size on the replica: a primary smaller than that (it has not learned of a grow
    /// yet) acts on the reply only once it has grown too, since the divergence may lie beyond
    /// its end.
    ProbeReply { epoch: u64, incarnation: u64, volume_blocks: u64, divergence: DivergenceReport },
    /// Replica to primary: I have no live stream from you; take me back. `last_term_epoch` is
    /// the newest epoch in which this process started a term as primary (0: none), and
    /// `divergence` its divergence list now: with them the primary can copy only what differs
    /// to a member that was in sync until the promotion (crate docs, "Resync").
    /// `volume_blocks` is the volume's size on the sender, as in `ProbeReply`.
    Hello {
        epoch: u64,
        incarnation: u64,
        last_term_epoch: u64,
        volume_blocks: u64,
        divergence: DivergenceReport,
    },
    /// Either way: I have seen `epoch`, newer than yours. The receiver adopts it; a primary
    /// that receives it is deposed.
    Stale { epoch: u64 },
    /// Replica to primary: your stream is not for my process (`incarnation`); I cannot apply it.
    Resync { epoch: u64, incarnation: u64 },
    /// Replica to primary: my storage failed; I acknowledge nothing more until restarted.
    Failed { epoch: u64, incarnation: u64 },
    /// Primary to an in-sync replica: send me your `count` blocks at `lba` (1 to
    /// `BLOCKS_PER_OP_MAX`), because my copy of them failed its checksum (crate docs, "Read
    /// repair"). `request` numbers the read within the term; `incarnation` is the replica
    /// process whose stream the primary holds.
    Read { epoch: u64, incarnation: u64, request: u64, lba: u64, count: u32 },
    /// Replica to primary: the blocks `Read` `request` asked for, one per block, or `None` if
    /// this replica cannot give them (it is not that process, holds no stream of this term
    /// from the primary, or its own copy is damaged or failed).
    ReadReply { epoch: u64, request: u64, blocks: Option<Vec<BlockData>> },
    /// Replica to primary: my copy of `count` blocks at `lba` (1 to `BLOCKS_PER_OP_MAX`) is
    /// damaged (the scrub found it); send me yours (crate docs, "Read repair"). `incarnation`
    /// is the sender's process. Sent again until a write replaces the blocks.
    Damaged { epoch: u64, incarnation: u64, lba: u64, count: u32 },
}

/// A message as it travels between two nodes. One connection carries the messages of many
/// volumes, so each names its volume; the receiver hands `message` to that volume's
/// `VolumeNode` as `Event::Message { from: sender, .. }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The volume the message is about, by the id the node and the control store give it.
    pub volume: u64,
    /// The node that sent it.
    pub sender: NodeId,
    pub message: Message,
}

impl Message {
    /// The epoch the sender held when it sent this.
    pub fn epoch(&self) -> u64 {
        match *self {
            Message::Append { epoch, .. }
            | Message::Heartbeat { epoch, .. }
            | Message::Ack { epoch, .. }
            | Message::Probe { epoch }
            | Message::ProbeReply { epoch, .. }
            | Message::Hello { epoch, .. }
            | Message::Stale { epoch }
            | Message::Resync { epoch, .. }
            | Message::Failed { epoch, .. }
            | Message::Read { epoch, .. }
            | Message::ReadReply { epoch, .. }
            | Message::Damaged { epoch, .. } => epoch,
        }
    }
}

#[cfg(test)]
// A list of one LBA range is what these tests mean, not a range collected into a list.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_into_the_canonical_form() {
        let check = |input: Vec<Range<u64>>, expected: Vec<Range<u64>>| {
            let merged = merge_ranges(input.clone());
            assert_eq!(merged, expected, "{input:?}");
            assert!(ranges_canonical(&merged));
            assert_eq!(ranges_canonical(&input), input == expected, "{input:?}");
        };
        check(vec![], vec![]);
        check(vec![5..5], vec![]);
        check(vec![0..2, 4..6], vec![0..2, 4..6]);
        check(vec![4..6, 0..2], vec![0..2, 4..6]);
        check(vec![0..2, 2..3], vec![0..3]);
        check(vec![0..10, 2..3, 9..12, 20..21], vec![0..12, 20..21]);
        check(vec![0..u64::MAX, 7..8], vec![0..u64::MAX]);
    }
}
