//! The simulation's judge: it records what the host saw and what the nodes did, and checks the
//! properties below after every step and at the end of a run.
//!
//! 1. Reads (linearizability, lite): a read of a block returns the value of some write to it
//!    that was issued before the read completed and had not been overwritten before the read
//!    was issued (overwritten: a later-issued write to the block completed before the read
//!    started). Never a value nobody wrote, never an older completed value. A deallocate is a
//!    write of zeros (an unmapped block), as is the volume's initial state; a read of zeros is
//!    right if any of those zero writes fits.
//! 2. Convergence: after healing and quiescing, every in-sync replica holds exactly the
//!    primary's blocks, and those pass check 1 (every completed write is there). And at every
//!    instant a replica joins the in-sync set (after a resync, full or incremental), it holds
//!    the primary's value of every block whose writes have all completed: only a write still
//!    pending (or failed) may leave the two apart.
//! 3. No split brain: no node completes a host command under an epoch once the store holds a
//!    newer one, and no two nodes complete commands under one epoch.
//! 4. Write intent: when a serving primary crashes, every block its host writes in flight
//!    reach is inside the write intent that survives the crash, unless that says unknown
//!    (checked by `World::crash`, which pushes its violations here).

use std::collections::BTreeMap;

use replication::BlockData;

/// Bytes of a block the simulation writes: LBA, write id and a check word, then zeros.
pub const VALUE_BYTES: usize = 24;

#[derive(Debug, Clone)]
struct WriteRecord {
    write_id: u64,
    /// A deallocate, or the initial state: the block reads as zeros (unmapped).
    zeros: bool,
    issued_ms: u64,
    completed_ms: Option<u64>,
}

/// The volume before any write: every block unmapped.
const INITIAL: WriteRecord =
    WriteRecord { write_id: 0, zeros: true, issued_ms: 0, completed_ms: Some(0) };

#[derive(Debug, Default)]
pub struct Checker {
    /// Per block, every write to it (write id 0 is the initial zeros).
    writes: BTreeMap<u64, Vec<WriteRecord>>,
    /// Which node completed commands under each epoch.
    completer: BTreeMap<u64, usize>,
    pub violations: Vec<String>,
    pub writes_completed: u64,
    pub reads_checked: u64,
}

pub fn encode(lba: u64, write_id: u64, block_bytes: usize) -> Vec<u8> {
    assert!(block_bytes >= VALUE_BYTES);
    let mut bytes = vec![0; block_bytes];
    bytes[0..8].copy_from_slice(&lba.to_le_bytes());
    bytes[8..16].copy_from_slice(&write_id.to_le_bytes());
    bytes[16..24].copy_from_slice(&(lba ^ write_id.rotate_left(17) ^ 0x5eed_f00d).to_le_bytes());
    bytes
}

/// The write id a block holds (0 for never written), or why it cannot be one of ours.
pub fn decode(lba: u64, block: &BlockData) -> Result<u64, String> {
    let Some(bytes) = block else { return Ok(0) };
    if bytes.len() < VALUE_BYTES {
        return Err(format!("block {lba} holds {} bytes", bytes.len()));
    }
    let word = |at: usize| {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&bytes[at..at + 8]);
        u64::from_le_bytes(raw)
    };
    let (stored_lba, write_id, check) = (word(0), word(8), word(16));
    if check != stored_lba ^ write_id.rotate_left(17) ^ 0x5eed_f00d {
        return Err(format!("block {lba} holds bytes no write produced"));
    }
    if stored_lba != lba {
        return Err(format!("block {lba} holds the data written to block {stored_lba}"));
    }
    Ok(write_id)
}

impl Checker {
    /// A write (`zeros` false) or a deallocate (`zeros` true) was issued.
    pub fn write_issued(
        &mut self,
        write_id: u64,
        zeros: bool,
        lbas: std::ops::Range<u64>,
        now_ms: u64,
    ) {
        for lba in lbas {
            let records = self.writes.entry(lba).or_insert_with(|| vec![INITIAL]);
            records.push(WriteRecord { write_id, zeros, issued_ms: now_ms, completed_ms: None });
        }
    }

    pub fn write_completed(&mut self, write_id: u64, lbas: std::ops::Range<u64>, now_ms: u64) {
        self.writes_completed += 1;
        for lba in lbas {
            let records = self.writes.get_mut(&lba).map(|records| records.iter_mut());
            if let Some(record) = records.and_then(|mut r| r.find(|r| r.write_id == write_id)) {
                record.completed_ms.get_or_insert(now_ms);
            }
        }
    }

    /// Check 1 for one block read between `issued_ms` and `completed_ms`.
    pub fn check_read(&mut self, lba: u64, block: &BlockData, issued_ms: u64, completed_ms: u64) {
        self.reads_checked += 1;
        let write_id = match decode(lba, block) {
            Ok(id) => id,
            Err(problem) => {
                self.violations.push(format!("read at {completed_ms} ms: {problem}"));
                return;
            }
        };
        let initial = [INITIAL];
        let records = self.writes.get(&lba).map_or(&initial[..], Vec::as_slice);
        // The writes that would leave this value: the one write of these bytes, or for zeros
        // the initial state and every deallocate.
        let zeros = block.is_none();
        let candidates: Vec<&WriteRecord> = records
            .iter()
            .filter(|record| if zeros { record.zeros } else { record.write_id == write_id })
            .collect();
        if candidates.is_empty() {
            self.violations.push(format!(
                "read of block {lba} at {completed_ms} ms returned write {write_id}, never written there"
            ));
            return;
        }
        let problems: Vec<String> = candidates
            .iter()
            .filter_map(|record| read_problem(lba, records, record, issued_ms, completed_ms))
            .collect();
        if problems.len() == candidates.len() {
            // None fits; the newest candidate's problem is the telling one.
            self.violations.extend(problems.last().cloned());
        }
    }

    /// Check 2 at the instant `member` joins the in-sync set of `primary`: their blocks may
    /// differ only where some write was issued that has not completed (it may be pending, or
    /// it failed and was reconciled either way).
    pub fn joined_in_sync(
        &mut self,
        now_ms: u64,
        member: usize,
        member_disk: &[BlockData],
        primary: usize,
        primary_disk: &[BlockData],
    ) {
        // Each may have grown with the volume before the other: a block beyond one's end is
        // unmapped there.
        let block = |disk: &[BlockData], lba: usize| disk.get(lba).cloned().flatten();
        let differing: Vec<usize> = (0..member_disk.len().max(primary_disk.len()))
            .filter(|&lba| block(member_disk, lba) != block(primary_disk, lba))
            .filter(|&lba| {
                self.writes.get(&(lba as u64)).is_none_or(|records| {
                    records.iter().all(|record| record.completed_ms.is_some())
                })
            })
            .take(8)
            .collect();
        if !differing.is_empty() {
            self.violations.push(format!(
                "n{member} joined the in-sync set at {now_ms} ms holding other values than \
                 primary n{primary} at blocks {differing:?}, whose writes all completed"
            ));
        }
    }

    /// Check 3 for one completion: `store_epoch` is the store's epoch at that instant.
    pub fn node_completed(&mut self, now_ms: u64, node: usize, epoch: u64, store_epoch: u64) {
        if store_epoch > epoch {
            self.violations.push(format!(
                "split brain: node {node} completed a command under epoch {epoch} at {now_ms} ms, \
                 when the store already held epoch {store_epoch}"
            ));
        }
        let completer = *self.completer.entry(epoch).or_insert(node);
        if completer != node {
            self.violations.push(format!(
                "split brain: nodes {completer} and {node} both completed commands under epoch {epoch}"
            ));
        }
    }
}

/// Why a read of `lba` (issued `issued_ms`, completed `completed_ms`) cannot have returned the
/// value of `record`, if it cannot.
fn read_problem(
    lba: u64,
    records: &[WriteRecord],
    record: &WriteRecord,
    issued_ms: u64,
    completed_ms: u64,
) -> Option<String> {
    let write_id = record.write_id;
    if record.issued_ms > completed_ms {
        return Some(format!(
            "read of block {lba} at {completed_ms} ms returned write {write_id} issued later"
        ));
    }
    let done_ms = record.completed_ms?;
    let newer = records.iter().find(|other| {
        other.issued_ms > done_ms && other.completed_ms.is_some_and(|c| c < issued_ms)
    })?;
    Some(format!(
        "stale read of block {lba} (issued {issued_ms} ms, completed {completed_ms} ms): \
         write {write_id} (completed {done_ms} ms) was overwritten by write {} \
         (issued {} ms, completed {:?} ms)",
        newer.write_id, newer.issued_ms, newer.completed_ms
    ))
}
