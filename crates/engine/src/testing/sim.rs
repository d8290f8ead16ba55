//! A drive in RAM that keeps what is durable apart from what was only written, so tests can crash
//! it, and that fails the Nth write or sync on request.
//!
//! The model is the pessimistic one a real drive allows:
//! - a write or punch becomes visible (and dirty) when it completes; while in flight its data may
//!   or may not reach the media;
//! - a sync persists the dirty blocks as they were when it started, and only if it succeeds;
//! - a crash keeps, drops or tears (per 512-byte sector) every block that was not durable, and
//!   every write still in flight;
//! - every operation yields a seeded number of times, so concurrent callers interleave.
//!
//! Blocks are kept sparse in ordered maps (absent = zeros), so a multi-GiB drive costs only what
//! was written, and iteration order (hence every run) is deterministic.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::rc::Rc;

use types::AlignedBuf;

use super::{yield_now, Rng};
use crate::drive::{check_request, Drive, DriveError, DriveOperation};

const BLOCK_BYTES: u64 = types::BLOCK_SIZE_BYTES as u64;
const SECTOR_BYTES: usize = 512;

/// What a simulated drive did, in order; the group-commit test checks the ordering rules on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimEvent {
    WriteDone {
        drive: u16,
        offset_bytes: u64,
    },
    SyncStarted {
        drive: u16,
    },
    SyncDone {
        drive: u16,
    },
    /// Pushed by a test when the store acknowledged a write.
    Acked {
        drive: u16,
        offset_bytes: u64,
    },
}

/// Counters of the operations a simulated drive served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    pub reads: u64,
    pub writes: u64,
    pub syncs: u64,
    pub punches: u64,
    /// Calls of `fill_holes`, and the blocks they wrote zeros over.
    pub lay_outs: u64,
    pub blocks_laid_out: u64,
    pub faults_injected: u64,
    /// The most writes and punches that were in flight on the drive at once.
    pub mutations_in_flight_peak: u64,
}

#[derive(Clone)]
struct WrittenBlock {
    version: u64,
    /// `None` for a punched block (zeros).
    data: Option<Rc<[u8]>>,
}

/// A mutation in flight: its blocks are not visible yet, but a crash may persist them.
struct InFlight {
    first_block: u64,
    /// One entry per block; `None` for a punch.
    blocks: Vec<Option<Rc<[u8]>>>,
}

struct SimState {
    index: u16,
    size_bytes: u64,
    rng: Rng,
    yields_max: u64,
    version_next: u64,
    written: BTreeMap<u64, WrittenBlock>,
    durable: BTreeMap<u64, Rc<[u8]>>,
    dirty: BTreeSet<u64>,
    in_flight: BTreeMap<u64, InFlight>,
    in_flight_next: u64,
    fail_write_countdown: Option<u64>,
    fail_sync_countdown: Option<u64>,
    /// The drive died: every operation fails.
    dead: bool,
    /// Reads touching these bytes fail (a bad region of a drive that is otherwise fine).
    unreadable: Option<std::ops::Range<u64>>,
    /// Writes that start or are in flight do not complete until released.
    writes_held: bool,
    stats: SimStats,
    events: Option<Rc<RefCell<Vec<SimEvent>>>>,
}

impl SimState {
    fn log(&self, event: SimEvent) {
        if let Some(events) = &self.events {
            events.borrow_mut().push(event);
        }
    }

    /// Counts down an injected fault; true when this operation must fail.
    fn fault_due(countdown: &mut Option<u64>) -> bool {
        match countdown {
            Some(1) => {
                *countdown = None;
                true
            }
            Some(remaining) => {
                *remaining -= 1;
                false
            }
            None => false,
        }
    }

    fn apply(&mut self, first_block: u64, blocks: Vec<Option<Rc<[u8]>>>) {
        for (number, data) in (first_block..).zip(blocks) {
            let version = self.version_next;
            self.version_next += 1;
            self.written.insert(number, WrittenBlock { version, data });
            self.dirty.insert(number);
        }
    }

    fn block(&self, number: u64) -> Option<&Rc<[u8]>> {
        self.written.get(&number).and_then(|block| block.data.as_ref())
    }
}

/// A simulated drive. Clones share the same drive, so a test keeps a handle to crash it or
/// inspect it after giving one to a store.
#[derive(Clone)]
pub struct SimDrive {
    state: Rc<RefCell<SimState>>,
}

impl SimDrive {
    /// A zeroed drive; `seed` drives its yields and crash outcomes; each operation yields up to
    /// `yields_max` times (a sync up to twice that).
    pub fn new(index: u16, size_bytes: u64, seed: u64, yields_max: u64) -> Self {
        assert_eq!(size_bytes % BLOCK_BYTES, 0);
        let state = SimState {
            index,
            size_bytes,
            rng: Rng::new(seed),
            yields_max,
            version_next: 1,
            written: BTreeMap::new(),
            durable: BTreeMap::new(),
            dirty: BTreeSet::new(),
            in_flight: BTreeMap::new(),
            in_flight_next: 0,
            fail_write_countdown: None,
            fail_sync_countdown: None,
            dead: false,
            unreadable: None,
            writes_held: false,
            stats: SimStats::default(),
            events: None,
        };
        Self { state: Rc::new(RefCell::new(state)) }
    }

    /// The `n`-th write from now (1 = the next) fails; it may have persisted part of its data.
    pub fn fail_write_after(&self, n: u64) {
        assert!(n > 0);
        self.state.borrow_mut().fail_write_countdown = Some(n);
    }

    /// The `n`-th sync from now (1 = the next) fails and persists nothing.
    pub fn fail_sync_after(&self, n: u64) {
        assert!(n > 0);
        self.state.borrow_mut().fail_sync_countdown = Some(n);
    }

    /// Reads that touch `range` (bytes) fail from now on, as over bad sectors; the rest of the
    /// drive works.
    pub fn fail_reads_in(&self, range: std::ops::Range<u64>) {
        self.state.borrow_mut().unreadable = Some(range);
    }

    /// The drive dies (or is pulled): every read, write, sync and punch fails from now on.
    pub fn fail_all(&self) {
        self.state.borrow_mut().dead = true;
    }

    /// Holds every write, in flight or to come, before it completes, until
    /// [`SimDrive::release_writes`]: what a slow drive looks like to a test that needs a batch
    /// to stay in flight while it watches what the writers do meanwhile.
    pub fn hold_writes(&self) {
        self.state.borrow_mut().writes_held = true;
    }

    pub fn release_writes(&self) {
        self.state.borrow_mut().writes_held = false;
    }

    /// Logs this drive's events into a log shared with other drives and the test.
    pub fn record_events(&self, events: Rc<RefCell<Vec<SimEvent>>>) {
        self.state.borrow_mut().events = Some(events);
    }

    pub fn stats(&self) -> SimStats {
        self.state.borrow().stats
    }

    /// Blocks written but not yet durable.
    pub fn dirty_block_count(&self) -> usize {
        self.state.borrow().dirty.len()
    }

    /// The durable image of a range: what a crash now would certainly keep.
    pub fn durable_bytes(&self, offset_bytes: u64, length_bytes: u64) -> Vec<u8> {
        let state = self.state.borrow();
        let mut bytes = vec![0u8; length_bytes as usize];
        let first = offset_bytes / BLOCK_BYTES;
        for (index, chunk) in bytes.chunks_mut(BLOCK_BYTES as usize).enumerate() {
            if let Some(data) = state.durable.get(&(first + index as u64)) {
                chunk.copy_from_slice(data);
            }
        }
        bytes
    }

    /// Power loss: every block that was not durable is kept, lost or torn, and so is every
    /// mutation still in flight. Afterwards the drive holds only its durable image.
    pub fn crash(&self) {
        let mut state = self.state.borrow_mut();
        let state = &mut *state;
        let in_flight = std::mem::take(&mut state.in_flight);
        for mutation in in_flight.into_values() {
            for (number, data) in (mutation.first_block..).zip(mutation.blocks) {
                let old = state.durable.get(&number).cloned();
                Self::settle(&mut state.rng, &mut state.durable, number, old, data);
            }
        }
        for number in std::mem::take(&mut state.dirty) {
            let old = state.durable.get(&number).cloned();
            let new = state.written.get(&number).and_then(|block| block.data.clone());
            Self::settle(&mut state.rng, &mut state.durable, number, old, new);
        }
        state.written.clear();
        for (number, data) in &state.durable {
            let version = state.version_next;
            state.version_next += 1;
            state.written.insert(*number, WrittenBlock { version, data: Some(Rc::clone(data)) });
        }
    }

    /// Chooses what a crash leaves of one non-durable block: the old, the new, or a sector mix.
    fn settle(
        rng: &mut Rng,
        durable: &mut BTreeMap<u64, Rc<[u8]>>,
        number: u64,
        old: Option<Rc<[u8]>>,
        new: Option<Rc<[u8]>>,
    ) {
        let result = match rng.below(3) {
            0 => old,
            1 => new,
            _ => {
                let zeros = [0u8; BLOCK_BYTES as usize];
                let old_bytes = old.as_deref().unwrap_or(&zeros);
                let new_bytes = new.as_deref().unwrap_or(&zeros);
                let mut torn = vec![0u8; BLOCK_BYTES as usize];
                for (sector, out) in torn.chunks_mut(SECTOR_BYTES).enumerate() {
                    let source = if rng.chance(1, 2) { old_bytes } else { new_bytes };
                    let range = sector * SECTOR_BYTES..(sector + 1) * SECTOR_BYTES;
                    out.copy_from_slice(&source[range]);
                }
                Some(Rc::from(torn))
            }
        };
        match result {
            Some(data) => durable.insert(number, data),
            None => durable.remove(&number),
        };
    }

    /// Yields a seeded number of times, up to `factor * yields_max`.
    async fn pause(&self, factor: u64) {
        let count = {
            let mut state = self.state.borrow_mut();
            let bound = state.yields_max * factor + 1;
            state.rng.below(bound)
        };
        for _ in 0..count {
            yield_now().await;
        }
    }

    fn check(
        &self,
        operation: DriveOperation,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(), DriveError> {
        let (size_bytes, dead, unreadable) = {
            let state = self.state.borrow();
            (state.size_bytes, state.dead, state.unreadable.clone())
        };
        let bad = unreadable.is_some_and(|range| {
            operation == DriveOperation::Read
                && offset_bytes < range.end
                && range.start < offset_bytes + length_bytes
        });
        if dead || bad {
            return Err(Self::injected(operation, offset_bytes, length_bytes));
        }
        check_request(operation, offset_bytes, length_bytes, size_bytes)
    }

    fn injected(operation: DriveOperation, offset_bytes: u64, length_bytes: u64) -> DriveError {
        DriveError::Io {
            operation,
            offset_bytes,
            length_bytes,
            source: io::Error::other("injected I/O error"),
        }
    }

    /// Starts a mutation: records it as in flight and returns its id.
    fn begin(&self, first_block: u64, blocks: Vec<Option<Rc<[u8]>>>) -> u64 {
        let mut state = self.state.borrow_mut();
        let id = state.in_flight_next;
        state.in_flight_next += 1;
        state.in_flight.insert(id, InFlight { first_block, blocks });
        state.stats.mutations_in_flight_peak =
            state.stats.mutations_in_flight_peak.max(state.in_flight.len() as u64);
        id
    }

    /// Completes a mutation: its blocks become visible and dirty.
    fn finish(&self, id: u64) {
        let mut state = self.state.borrow_mut();
        if let Some(mutation) = state.in_flight.remove(&id) {
            state.apply(mutation.first_block, mutation.blocks);
        }
    }
}

impl Drive for SimDrive {
    async fn read_at(
        &self,
        offset_bytes: u64,
        mut buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        if let Err(error) = self.check(DriveOperation::Read, offset_bytes, length_bytes) {
            return (Err(error), buf);
        }
        self.pause(1).await;
        let mut state = self.state.borrow_mut();
        state.stats.reads += 1;
        let first = offset_bytes / BLOCK_BYTES;
        for (index, chunk) in buf.chunks_mut(BLOCK_BYTES as usize).enumerate() {
            match state.block(first + index as u64) {
                Some(data) => chunk.copy_from_slice(data),
                None => chunk.fill(0),
            }
        }
        (Ok(()), buf)
    }

    async fn write_at(
        &self,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (Result<(), DriveError>, AlignedBuf) {
        let length_bytes = buf.len() as u64;
        if let Err(error) = self.check(DriveOperation::Write, offset_bytes, length_bytes) {
            return (Err(error), buf);
        }
        let blocks: Vec<Option<Rc<[u8]>>> =
            buf.chunks(BLOCK_BYTES as usize).map(|block| Some(Rc::from(block))).collect();
        let block_count = blocks.len();
        let fault = {
            let mut state = self.state.borrow_mut();
            state.stats.writes += 1;
            SimState::fault_due(&mut state.fail_write_countdown)
        };
        let id = self.begin(offset_bytes / BLOCK_BYTES, blocks);
        self.pause(1).await;
        while self.state.borrow().writes_held {
            yield_now().await;
        }
        if fault {
            // A failed write may have reached the media in part: keep a seeded prefix visible.
            let mut state = self.state.borrow_mut();
            state.stats.faults_injected += 1;
            let kept = state.rng.below(block_count as u64 + 1) as usize;
            if let Some(mut mutation) = state.in_flight.remove(&id) {
                mutation.blocks.truncate(kept);
                state.apply(mutation.first_block, mutation.blocks);
            }
            let error = Self::injected(DriveOperation::Write, offset_bytes, length_bytes);
            return (Err(error), buf);
        }
        self.finish(id);
        let state = self.state.borrow();
        state.log(SimEvent::WriteDone { drive: state.index, offset_bytes });
        (Ok(()), buf)
    }

    async fn sync(&self) -> Result<(), DriveError> {
        let (snapshot, fault) = {
            let mut state = self.state.borrow_mut();
            state.stats.syncs += 1;
            state.log(SimEvent::SyncStarted { drive: state.index });
            let fault = SimState::fault_due(&mut state.fail_sync_countdown) || state.dead;
            let snapshot: Vec<(u64, WrittenBlock)> =
                state.dirty.iter().map(|number| (*number, state.written[number].clone())).collect();
            (snapshot, fault)
        };
        self.pause(2).await;
        let mut state = self.state.borrow_mut();
        if fault {
            state.stats.faults_injected += 1;
            return Err(Self::injected(DriveOperation::Sync, 0, 0));
        }
        for (number, block) in snapshot {
            match &block.data {
                Some(data) => state.durable.insert(number, Rc::clone(data)),
                None => state.durable.remove(&number),
            };
            if state.written.get(&number).map(|current| current.version) == Some(block.version) {
                state.dirty.remove(&number);
            }
        }
        state.log(SimEvent::SyncDone { drive: state.index });
        Ok(())
    }

    /// A hole is a block never written or punched since (a crash keeps zeros written over one
    /// as data). The holes are found when the call starts and filled after a pause, so a
    /// write that lands in one meanwhile (which the caller must prevent) is overwritten with
    /// zeros, as it could be on a real filesystem.
    async fn fill_holes(&self, offset_bytes: u64, length_bytes: u64) -> Result<u64, DriveError> {
        self.check(DriveOperation::LayOut, offset_bytes, length_bytes)?;
        let first = offset_bytes / BLOCK_BYTES;
        let end = first + length_bytes / BLOCK_BYTES;
        let holes: Vec<u64> = {
            let mut state = self.state.borrow_mut();
            state.stats.lay_outs += 1;
            (first..end).filter(|number| state.block(*number).is_none()).collect()
        };
        self.pause(1).await;
        if holes.is_empty() {
            return Ok(0);
        }
        let zeros: Rc<[u8]> = Rc::from(vec![0u8; BLOCK_BYTES as usize]);
        let mut index = 0;
        while index < holes.len() {
            let run_start = holes[index];
            let mut run_length = 1;
            while index + run_length < holes.len()
                && holes[index + run_length] == run_start + run_length as u64
            {
                run_length += 1;
            }
            let id = self.begin(run_start, vec![Some(Rc::clone(&zeros)); run_length]);
            self.pause(1).await;
            self.finish(id);
            index += run_length;
        }
        self.state.borrow_mut().stats.blocks_laid_out += holes.len() as u64;
        self.sync().await?;
        Ok(holes.len() as u64 * BLOCK_BYTES)
    }

    async fn punch_hole(&self, offset_bytes: u64, length_bytes: u64) -> Result<(), DriveError> {
        self.check(DriveOperation::PunchHole, offset_bytes, length_bytes)?;
        let first = offset_bytes / BLOCK_BYTES;
        let end = first + length_bytes / BLOCK_BYTES;
        // Only blocks that hold data change; the rest already read as zeros.
        let (start, blocks) = {
            let mut state = self.state.borrow_mut();
            state.stats.punches += 1;
            let mut numbers: BTreeSet<u64> =
                state.written.range(first..end).map(|(n, _)| *n).collect();
            numbers.extend(state.durable.range(first..end).map(|(n, _)| *n));
            (numbers.first().copied(), numbers)
        };
        let mut ids = Vec::new();
        if let Some(start) = start {
            // One in-flight record per run of consecutive blocks.
            let mut run_start = start;
            let mut run_length = 0u64;
            for number in blocks.iter().copied().chain(std::iter::once(u64::MAX)) {
                if number == run_start + run_length {
                    run_length += 1;
                    continue;
                }
                ids.push(self.begin(run_start, vec![None; run_length as usize]));
                run_start = number;
                run_length = 1;
            }
        }
        self.pause(1).await;
        for id in ids {
            self.finish(id);
        }
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.state.borrow().size_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::block_on;

    fn buffer(byte: u8, blocks: usize) -> AlignedBuf {
        let mut buf = AlignedBuf::new(blocks * BLOCK_BYTES as usize);
        buf.fill(byte);
        buf
    }

    fn read(drive: &SimDrive, offset_bytes: u64, blocks: usize) -> AlignedBuf {
        let (result, buf) = block_on(drive.read_at(offset_bytes, buffer(0xee, blocks)));
        result.unwrap();
        buf
    }

    #[test]
    fn durable_only_after_sync() {
        let drive = SimDrive::new(0, 1 << 20, 1, 2);
        block_on(drive.write_at(4096, buffer(7, 2))).0.unwrap();
        assert!(read(&drive, 4096, 2).iter().all(|b| *b == 7));
        assert!(drive.durable_bytes(4096, 8192).iter().all(|b| *b == 0));
        block_on(drive.sync()).unwrap();
        assert!(drive.durable_bytes(4096, 8192).iter().all(|b| *b == 7));
        assert_eq!(drive.dirty_block_count(), 0);
        block_on(drive.punch_hole(4096, 4096)).unwrap();
        assert!(read(&drive, 0, 3).iter().take(8192).all(|b| *b == 0));
        assert_eq!(drive.dirty_block_count(), 1);
        block_on(drive.sync()).unwrap();
        assert!(drive.durable_bytes(4096, 4096).iter().all(|b| *b == 0));
        drive.crash();
        assert!(read(&drive, 8192, 1).iter().all(|b| *b == 7), "durable data survives a crash");
    }

    #[test]
    fn crash_keeps_drops_or_tears_unsynced_blocks() {
        let mut outcomes = BTreeSet::new();
        for seed in 0..40 {
            let drive = SimDrive::new(0, 1 << 20, seed, 0);
            block_on(drive.write_at(0, buffer(1, 1))).0.unwrap();
            block_on(drive.sync()).unwrap();
            block_on(drive.write_at(0, buffer(2, 1))).0.unwrap();
            drive.crash();
            let block = read(&drive, 0, 1);
            let ones = block.iter().filter(|b| **b == 1).count();
            let twos = block.iter().filter(|b| **b == 2).count();
            assert_eq!(ones + twos, 4096);
            assert_eq!(ones % SECTOR_BYTES, 0, "tears fall on sector boundaries");
            outcomes.insert(match (ones, twos) {
                (4096, 0) => "old",
                (0, 4096) => "new",
                _ => "torn",
            });
        }
        assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    }

    #[test]
    fn injected_faults_fire_once() {
        let drive = SimDrive::new(0, 1 << 20, 3, 0);
        drive.fail_write_after(2);
        drive.fail_sync_after(1);
        assert!(block_on(drive.write_at(0, buffer(1, 1))).0.is_ok());
        assert!(block_on(drive.write_at(0, buffer(1, 1))).0.is_err());
        assert!(block_on(drive.write_at(0, buffer(1, 1))).0.is_ok());
        assert!(block_on(drive.sync()).is_err());
        assert!(block_on(drive.sync()).is_ok());
        assert_eq!(drive.stats().faults_injected, 2);
        let (result, _) = block_on(drive.write_at(1 << 20, buffer(1, 1)));
        assert!(matches!(result, Err(DriveError::OutOfBounds { .. })));
    }
}
