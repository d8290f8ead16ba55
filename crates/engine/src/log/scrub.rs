//! Background scrub (issue 5): reads every live block of the sealed segments back, in segment
//! order, and checks it against the CRC-32C its batch header records, so damage is found while
//! it can still be acted on rather than when a host happens to read the block. It also walks each
//! segment's batch header chain, which GC and recovery depend on, and reports a chain that ends
//! before every live block of the segment was found.
//!
//! Scrub only reads: it never takes the handle's pipeline leadership, so it cannot hold up host
//! writes, and each [`LogHandle::scrub_step`] does bounded work ([`SCRUB_BLOCKS_PER_STEP_MAX`]
//! blocks, [`SCRUB_HEADERS_PER_STEP_MAX`] headers) so the caller paces it. Which blocks are live
//! is decided as GC decides it: a block is live if the layer its batch entry names (following
//! merges) still maps exactly the entry that batch installed. A raw block is checked with the
//! CRC-32C of its 4 KiB; a compressed one is unpacked from its pack slot and the CRC-32C of its
//! uncompressed bytes checked (as a read does). A block that fails is damage only if the index
//! still maps it there after the read: GC or a host write may have moved it, and GC may even have
//! freed and reused the segment, while the read was in flight.
//!
//! Repair (coded logs): a damaged live block is rebuilt from the rest of its stripe and, if the
//! rebuilt bytes pass its checksum, written back in place (its cell is immutable by design, so
//! rewriting it with the verified bytes restores it; the segment is pinned meanwhile so it cannot
//! be reused underneath). Then, once every live block of a batch is intact, the parity of the
//! batch's stripes is recomputed from its data and any parity cell that differs is rewritten the
//! same way ([`ScrubDamage::Parity`]), so a later drive loss rebuilds right; not in a segment
//! where a drive's cells cannot be read (latched, or being rebuilt and not restored there yet),
//! whose parity there is nothing to judge against. A batch header cell
//! that does not decode where the segment's chain must go on (live blocks remain past it) is
//! rebuilt from its stripe the same way, written back ([`ScrubDamage::Header`]) and the walk goes
//! on with it, as GC and recovery do; only a header the stripe cannot rebuild ends the chain
//! early ([`ScrubDamage::HeaderChain`]). Without parity
//! nothing can be repaired: damaged blocks stay mapped and their reads keep failing with
//! [`LogError::ChecksumMismatch`]. Scrub counts damage in `scrub_errors`, not in
//! `checksum_errors`, which counts failed host reads (a block found by scrub and then read by a
//! host would otherwise count twice), and keeps the most recent findings
//! ([`SCRUB_FINDINGS_MAX`]).

use std::sync::atomic::Ordering;

use super::engine::{LogEngine, LogHandle};
use super::format::{BatchHeader, DataSlots, EntryKind, BATCH_ENTRIES_MAX, BLOCK_BYTES};
use super::index::{entry_units, pack, packed_tag, raw_tag};
use super::segments::SegmentState;
use super::LogError;
use crate::compress::{self, Block, CompressScratch};
use crate::drive::Drive;

/// The most blocks one [`LogHandle::scrub_step`] verifies, whatever the caller asks for.
pub const SCRUB_BLOCKS_PER_STEP_MAX: u32 = 4096;
/// The most batch headers one [`LogHandle::scrub_step`] reads: bounds the I/O of a step over
/// batches with few or no live blocks.
pub const SCRUB_HEADERS_PER_STEP_MAX: u32 = 64;
/// The most recent findings the engine keeps (older ones are dropped; the counters keep the
/// totals).
pub const SCRUB_FINDINGS_MAX: usize = 64;

/// Where a scrub stands: the segment and batch it verifies next, and the passes it completed.
/// The caller keeps it between steps; a new cursor starts a pass at segment 0.
#[derive(Debug, Default)]
pub struct ScrubCursor {
    segment: u32,
    /// The position of the header of the batch verified next.
    position: u32,
    /// The next entry of that batch to verify: a step may end inside a batch.
    entry_index: usize,
    /// The segment's sequence number when its walk began (`None` before): a segment freed and
    /// reused meanwhile holds other batches, and its walk is abandoned.
    segment_seq: Option<u64>,
    /// Live-space units (see `index::UNITS_PER_POSITION`) of the live blocks the walk of the
    /// segment found so far. More live units in the segment than the whole chain leads to means
    /// a header in the chain is damaged.
    live_units_found: u32,
    passes_completed: u64,
    /// Decompression contexts and a block buffer, made when the first compressed block is met
    /// and kept for the scrub's life (a few hundred KiB).
    unpacking: Option<Box<Unpacking>>,
    /// Coded logs: the batch being verified holds a damaged live block that was not repaired,
    /// so its parity must not be recomputed from its data.
    batch_unrepaired: bool,
}

/// What unpacking a compressed block needs.
#[derive(Debug)]
struct Unpacking {
    scratch: CompressScratch,
    block: Block,
}

impl ScrubCursor {
    pub fn new() -> Self {
        Self::default()
    }

    /// The segment being verified (progress through a pass: this over the segment count).
    pub fn segment(&self) -> u32 {
        self.segment
    }

    /// Full passes over every segment completed with this cursor.
    pub fn passes_completed(&self) -> u64 {
        self.passes_completed
    }

    fn begin_segment(&mut self, seq: u64) {
        self.position = 0;
        self.entry_index = 0;
        self.segment_seq = Some(seq);
        self.live_units_found = 0;
    }

    fn next_segment(&mut self) {
        self.segment += 1;
        self.position = 0;
        self.entry_index = 0;
        self.segment_seq = None;
        self.live_units_found = 0;
    }

    fn complete_pass(&mut self) {
        self.segment = 0;
        self.position = 0;
        self.entry_index = 0;
        self.segment_seq = None;
        self.live_units_found = 0;
        self.passes_completed += 1;
    }
}

/// What one [`LogHandle::scrub_step`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScrubProgress {
    /// Live blocks whose data matched their checksum.
    pub blocks_verified: u32,
    /// Live blocks whose data did not (each is a [`ScrubFinding`]).
    pub blocks_damaged: u32,
    /// Damaged blocks rebuilt from parity and rewritten (coded logs).
    pub blocks_repaired: u32,
    /// Segments whose batch header chain ended before every live block was found.
    pub chains_damaged: u32,
    /// Coded logs: batch header cells that did not decode although the chain went on, each
    /// rebuilt from parity (the walk went on with the rebuilt header), and those rewritten.
    pub headers_damaged: u32,
    pub headers_repaired: u32,
    /// Coded logs: stripes whose parity did not match their data, and those rewritten.
    pub parity_damaged: u32,
    pub parity_repaired: u32,
    /// The step reached the end of the last segment: a pass is complete and the cursor is back
    /// at segment 0.
    pub pass_completed: bool,
}

impl ScrubProgress {
    fn blocks_checked(&self) -> u32 {
        self.blocks_verified + self.blocks_damaged
    }
}

/// What is damaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrubDamage {
    /// Block `block` of the layer labelled `label` (a volume's id for a volume never
    /// snapshotted, else an engine label; see docs/format-log-v1.md) failed its checksum; reads
    /// of it fail with [`LogError::ChecksumMismatch`].
    Block { label: u64, block: u64 },
    /// The segment's batch header chain ends at the finding's location although live blocks of
    /// the segment (`live_units_unreachable` live-space units of them) lie beyond it: their data
    /// may be intact (reads check it), but GC cannot relocate them and recovery would not
    /// replay batches past that point.
    HeaderChain { segment: u32, live_units_unreachable: u32 },
    /// Coded logs: the batch header cell at the finding's location did not decode (damaged, or
    /// stale on a drive that missed its write) and was rebuilt from the rest of its stripe; GC
    /// and recovery rebuild it the same way until it is rewritten.
    Header { segment: u32 },
    /// Coded logs: the parity of stripe `stripe` of the segment did not match its data; a lost
    /// drive would have been rebuilt wrong there (and failed its checksums).
    Parity { segment: u32, stripe: u32 },
}

/// One piece of damage scrub found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrubFinding {
    pub damage: ScrubDamage,
    /// The log location of the damaged block (its pack slot if compressed), or of the header
    /// position where the chain ends.
    pub location: u32,
    /// The drive holding that location.
    pub drive: u16,
    /// The pass that found it, counting from 1 (the cursor's completed passes plus one). Damage
    /// found again in a later pass is kept once, with the later pass.
    pub pass: u64,
    /// Whether it was repaired: rebuilt from parity and rewritten (coded logs), or replaced
    /// from another replica's copy ([`LogEngine::mark_scrub_block_repaired`], cluster nodes).
    pub repaired: bool,
}

/// A live block of the batch being verified.
struct LiveBlock {
    /// The label the batch entry names, resolved again before damage is reported.
    label: u64,
    block: u64,
    /// The index entry the batch installed (and the index still held when it was collected).
    entry: u64,
    /// The full CRC-32C of the block's (uncompressed) bytes, from the batch header.
    crc: u32,
    /// `Some(sub)` for a compressed block: its sub-index in the pack slot.
    packed_sub: Option<u8>,
    location: u32,
    /// The data block of the batch holding it.
    data_index: u32,
}

/// Whether `bytes`, read from where `found` lives, are that block: the CRC-32C of a raw block,
/// or of a compressed one unpacked from its slot.
fn block_intact(bytes: &[u8], found: &LiveBlock, unpacking: &mut Option<Box<Unpacking>>) -> bool {
    match found.packed_sub {
        None => crc32c::crc32c(bytes) == found.crc,
        Some(sub) => {
            let unpacking = unpacking.get_or_insert_with(|| {
                Box::new(Unpacking { scratch: CompressScratch::new(), block: [0; BLOCK_BYTES] })
            });
            let Ok(slot) = <&Block>::try_from(bytes) else { return false };
            let Unpacking { scratch, block } = &mut **unpacking;
            compress::unpack(slot, sub, block, scratch).is_ok_and(|crc| crc == found.crc)
        }
    }
}

impl LogEngine {
    /// The most recent damage scrub found (at most [`SCRUB_FINDINGS_MAX`]), oldest first.
    pub fn scrub_findings(&self) -> Vec<ScrubFinding> {
        let findings = self.counters.scrub_findings.lock().unwrap_or_else(|e| e.into_inner());
        findings.iter().copied().collect()
    }

    /// Marks the findings of block `block` of the layer `label` repaired: the block was
    /// replaced from another copy outside the engine (a replica's, on a cluster node). Returns
    /// whether any finding changed.
    pub fn mark_scrub_block_repaired(&self, label: u64, block: u64) -> bool {
        let mut findings = self.counters.scrub_findings.lock().unwrap_or_else(|e| e.into_inner());
        let mut changed = false;
        for finding in findings.iter_mut() {
            if finding.damage == (ScrubDamage::Block { label, block }) && !finding.repaired {
                finding.repaired = true;
                changed = true;
            }
        }
        changed
    }

    /// Counts a finding and keeps it, in place of an earlier finding of the same damage.
    fn record_scrub_finding(&self, finding: ScrubFinding) {
        self.counters.scrub_errors.fetch_add(1, Ordering::Relaxed);
        let mut findings = self.counters.scrub_findings.lock().unwrap_or_else(|e| e.into_inner());
        findings.retain(|old| (old.damage, old.location) != (finding.damage, finding.location));
        if findings.len() >= SCRUB_FINDINGS_MAX {
            findings.pop_front();
        }
        findings.push_back(finding);
    }
}

impl<D: Drive> LogHandle<D> {
    /// Verifies at most `blocks_max` (and at most [`SCRUB_BLOCKS_PER_STEP_MAX`]) live blocks of
    /// the sealed segments, from where `cursor` stands, and moves it on. Free, open, checkpoint
    /// and cleaning segments are skipped (an open one is scrubbed once sealed, in a later pass).
    /// Damage is counted in the engine and kept in [`LogEngine::scrub_findings`]; it is not an
    /// error of the step. An I/O error is: the cursor has then moved past what could not be read
    /// (so one unreadable batch does not stop the scrub) and the caller reports the error.
    pub async fn scrub_step(
        &self,
        cursor: &mut ScrubCursor,
        blocks_max: u32,
    ) -> Result<ScrubProgress, LogError> {
        assert!(blocks_max > 0, "a scrub step verifies at least one block");
        let budget = blocks_max.min(SCRUB_BLOCKS_PER_STEP_MAX);
        let engine = &*self.engine;
        let geometry = engine.geometry;
        let per_segment = geometry.positions_per_segment();
        let mut progress = ScrubProgress::default();
        let mut headers_read = 0;
        // Each round reads one header (at most SCRUB_HEADERS_PER_STEP_MAX rounds) or moves to the
        // next segment (at most the segment count, after which the pass wraps and the step ends).
        while progress.blocks_checked() < budget && headers_read < SCRUB_HEADERS_PER_STEP_MAX {
            if cursor.segment >= geometry.segment_count {
                cursor.complete_pass();
                engine.counters.scrub_passes.fetch_add(1, Ordering::Relaxed);
                progress.pass_completed = true;
                break;
            }
            let segment = cursor.segment;
            let seq = engine.segments.seq(segment);
            let sealed = engine.segments.state(segment) == SegmentState::Sealed;
            match cursor.segment_seq {
                None if sealed && engine.segments.live_units(segment) > 0 => {
                    cursor.begin_segment(seq);
                }
                Some(walking) if sealed && walking == seq => {}
                _ => {
                    cursor.next_segment();
                    continue;
                }
            }
            if cursor.position >= per_segment || engine.segments.live_units(segment) == 0 {
                self.end_chain(cursor, &mut progress);
                continue;
            }
            headers_read += 1;
            let position = cursor.position;
            let block = match self.read_positions(segment, position, 1).await {
                Ok(block) => block,
                Err(error) => {
                    cursor.next_segment();
                    return Err(error);
                }
            };
            let decoded = BatchHeader::decode(&block, &geometry, segment, position)
                .ok()
                .filter(|header| header.segment_seq == seq);
            self.recycle(block);
            let header = match decoded {
                Some(header) => header,
                // The chain ends here: normally (the segment's unwritten tail, or a header of an
                // earlier use of the segment), or at a damaged header, which a coded log
                // rebuilds and a log without parity reports (see `end_chain`).
                None => match self.rebuilt_chain_header(cursor, seq, &mut progress).await {
                    Some(header) => header,
                    None => {
                        self.end_chain(cursor, &mut progress);
                        continue;
                    }
                },
            };
            self.scrub_batch(cursor, &header, budget, &mut progress).await?;
        }
        Ok(progress)
    }

    /// Verifies the live blocks of one batch from `cursor.entry_index` on, within the budget,
    /// and moves the cursor past what it covered (before reading, so a failed read is skipped).
    async fn scrub_batch(
        &self,
        cursor: &mut ScrubCursor,
        header: &BatchHeader,
        budget: u32,
        progress: &mut ScrubProgress,
    ) -> Result<(), LogError> {
        let engine = &*self.engine;
        let geometry = engine.geometry;
        let (segment, position) = (header.segment, header.position);
        let mut live: Vec<LiveBlock> = Vec::with_capacity(BATCH_ENTRIES_MAX);
        // Which data block each entry's data is in depends on every entry before it.
        let mut slots = DataSlots::default();
        let mut resume_at = None;
        for (entry_index, entry) in header.entries.iter().enumerate() {
            let Some(data_index) = slots.next(&entry.kind) else { continue };
            if entry_index < cursor.entry_index {
                continue;
            }
            if progress.blocks_checked() + live.len() as u32 >= budget {
                resume_at = Some(entry_index);
                break;
            }
            let location = geometry.location(segment, position + 1 + data_index);
            // The index entry the batch installed, as `LogEngine::apply` builds it.
            let (tag, crc, packed_sub) = match entry.kind {
                EntryKind::Data { crc } | EntryKind::Relocated { crc, .. } => {
                    (raw_tag(crc), crc, None)
                }
                EntryKind::Packed { crc, cells_log2, sub, .. }
                | EntryKind::RelocatedPacked { crc, cells_log2, sub, .. } => {
                    (packed_tag(cells_log2, sub, crc), crc, Some(sub))
                }
                _ => continue,
            };
            let installed = pack(location, tag);
            // The entry names the layer the block was written to; it may have been merged into
            // its child since (resolve_label follows that).
            let mapped_here = engine
                .index
                .resolve_label(entry.volume)
                .is_some_and(|layer| layer.get(entry.block) == installed);
            if mapped_here {
                live.push(LiveBlock {
                    label: entry.volume,
                    block: entry.block,
                    entry: installed,
                    crc,
                    packed_sub,
                    location,
                    data_index,
                });
            }
        }
        cursor.live_units_found += live.iter().map(|found| entry_units(found.entry)).sum::<u32>();
        let batch_done = resume_at.is_none();
        match resume_at {
            Some(entry_index) => cursor.entry_index = entry_index,
            None => {
                cursor.position += geometry.padded(header.positions());
                cursor.entry_index = 0;
            }
        }
        let Some(first) = live.iter().map(|found| found.data_index).min() else {
            if batch_done {
                cursor.batch_unrepaired = false;
            }
            return Ok(());
        };
        let last = live.iter().map(|found| found.data_index).max().unwrap_or(first);
        let data = self.read_positions(segment, position + 1 + first, last - first + 1).await?;
        let pass = cursor.passes_completed + 1;
        for found in &live {
            let at = (found.data_index - first) as usize * BLOCK_BYTES;
            let bytes = &data[at..at + BLOCK_BYTES];
            if block_intact(bytes, found, &mut cursor.unpacking) {
                progress.blocks_verified += 1;
                engine.counters.scrub_blocks_verified.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            // Damage only if the index still maps the block there now that the read is done:
            // otherwise GC or a host write moved it (and GC may have reused the segment).
            let Some(owner) = engine
                .index
                .resolve_label(found.label)
                .filter(|layer| layer.get(found.block) == found.entry)
            else {
                continue;
            };
            if engine.segments.seq(segment) != header.segment_seq {
                continue;
            }
            progress.blocks_damaged += 1;
            let block_position = position + 1 + found.data_index;
            let repaired = geometry.is_coded()
                && self
                    .repair_position(segment, header.segment_seq, block_position, |rebuilt| {
                        block_intact(rebuilt, found, &mut cursor.unpacking)
                    })
                    .await;
            if repaired {
                progress.blocks_repaired += 1;
            } else {
                cursor.batch_unrepaired = true;
            }
            engine.record_scrub_finding(ScrubFinding {
                damage: ScrubDamage::Block { label: owner.volume(), block: found.block },
                location: found.location,
                drive: geometry.place(segment, block_position).0,
                pass,
                repaired,
            });
        }
        if batch_done && geometry.is_coded() && !cursor.batch_unrepaired {
            let (wrong, repaired) = self
                .verify_parity(segment, header.segment_seq, position, header.positions())
                .await?;
            progress.parity_damaged += wrong.len() as u32;
            progress.parity_repaired += repaired;
            for stripe in wrong {
                let cell = geometry.cell(stripe, u32::from(geometry.data_shards));
                let (drive, _) = geometry.cell_drive_row(cell);
                engine.record_scrub_finding(ScrubFinding {
                    damage: ScrubDamage::Parity { segment, stripe },
                    location: geometry.location(segment, stripe * u32::from(geometry.data_shards)),
                    drive,
                    pass,
                    repaired: repaired > 0,
                });
            }
        }
        if batch_done {
            cursor.batch_unrepaired = false;
        }
        Ok(())
    }

    /// Coded logs: the header cell at the cursor does not hold a header of the segment's
    /// sequence `seq`, yet the segment holds more live units than the walk found (so a batch of
    /// it lies here or further on): the cell is damaged or stale. Rebuilds it from its stripe;
    /// if that is a header of this segment, writes it back in place (as a damaged block is),
    /// reports it ([`ScrubDamage::Header`]) and returns it, so the walk goes on past it. None
    /// where the chain really ends, without parity, or if the stripe cannot rebuild it.
    async fn rebuilt_chain_header(
        &self,
        cursor: &ScrubCursor,
        seq: u64,
        progress: &mut ScrubProgress,
    ) -> Option<BatchHeader> {
        let engine = &*self.engine;
        let geometry = engine.geometry;
        let (segment, position) = (cursor.segment, cursor.position);
        if !geometry.is_coded() || engine.segments.live_units(segment) <= cursor.live_units_found {
            return None;
        }
        let header = self.rebuilt_header_of(segment, seq, position).await?;
        let repaired = self
            .repair_position(segment, seq, position, |bytes| {
                BatchHeader::decode(bytes, &geometry, segment, position)
                    .is_ok_and(|decoded| decoded.segment_seq == seq)
            })
            .await;
        progress.headers_damaged += 1;
        if repaired {
            progress.headers_repaired += 1;
        }
        engine.record_scrub_finding(ScrubFinding {
            damage: ScrubDamage::Header { segment },
            location: geometry.location(segment, position),
            drive: geometry.place(segment, position).0,
            pass: cursor.passes_completed + 1,
            repaired,
        });
        Some(header)
    }

    /// The walk of the cursor's segment reached the end of its header chain: reports the chain
    /// as damaged if the segment holds more live units than the chain led to, then moves on.
    /// Live counts of a sealed segment only fall, so every block live now at a position the walk
    /// passed was counted then: more live units now than found means some lie past the end.
    fn end_chain(&self, cursor: &mut ScrubCursor, progress: &mut ScrubProgress) {
        let engine = &*self.engine;
        let geometry = engine.geometry;
        let segment = cursor.segment;
        let live_units = engine.segments.live_units(segment);
        // Read after the live count: a segment freed and reused since has another sequence.
        let unchanged = engine.segments.state(segment) == SegmentState::Sealed
            && cursor.segment_seq == Some(engine.segments.seq(segment));
        if unchanged && live_units > cursor.live_units_found {
            let position = cursor.position.min(geometry.positions_per_segment() - 1);
            progress.chains_damaged += 1;
            engine.record_scrub_finding(ScrubFinding {
                damage: ScrubDamage::HeaderChain {
                    segment,
                    live_units_unreachable: live_units - cursor.live_units_found,
                },
                location: geometry.location(segment, position),
                drive: geometry.place(segment, position).0,
                pass: cursor.passes_completed + 1,
                repaired: false,
            });
        }
        cursor.next_segment();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use types::AlignedBuf;

    use super::{ScrubCursor, ScrubDamage, ScrubFinding, ScrubProgress};
    use crate::compress::{
        cells_log2_for, compress_block, CompressScratch, Compression, PackBuilder,
    };
    use crate::drive::Drive;
    use crate::format::{NodeUuid, HEADER_REGION_BYTES};
    use crate::latches::DriveLatches;
    use crate::log::engine::Stream;
    use crate::log::format::{BatchHeader, Entry, EntryKind, BLOCK_BYTES, LOG_HEADER_BYTES};
    use crate::log::index::{entry_units, unpack};
    use crate::log::segments::SegmentState;
    use crate::log::{LogConfig, LogEngine, LogError, LogHandle};
    use crate::testing::{block_on, fill_block, SimDrive};
    use crate::volumes::{VolumeId, VolumeMap, Volumes};

    const BLOCK: u64 = BLOCK_BYTES as u64;
    const DRIVES: u16 = 2;
    const SEGMENTS: u64 = 48;
    const VOLUME: VolumeId = VolumeId(1);
    const VOLUME_BLOCKS: u64 = 512;
    /// Steps a pass may take in these tests before one is declared stuck.
    const STEPS_MAX: u32 = 10_000;

    fn config() -> LogConfig {
        LogConfig {
            unit_bytes: 64 << 10,
            handles_max: 2,
            checkpoint_interval_segments: 4,
            ..LogConfig::new(NodeUuid([0x5c; 16]))
        }
    }

    /// A node over simulated drives with one volume.
    struct Node {
        drives: Vec<SimDrive>,
        engine: Arc<LogEngine>,
        handle: LogHandle<SimDrive>,
        map: Arc<VolumeMap>,
        _volumes: Volumes,
    }

    impl Node {
        fn format() -> Self {
            let size_bytes =
                HEADER_REGION_BYTES + LOG_HEADER_BYTES + SEGMENTS * config().unit_bytes;
            let drives: Vec<SimDrive> = (0..DRIVES)
                .map(|index| SimDrive::new(index, size_bytes, 31 + u64::from(index), 1))
                .collect();
            block_on(LogEngine::format(&drives, &config())).unwrap();
            let volumes = Volumes::new();
            volumes.publish(volumes.reserve_create(VOLUME, VOLUME_BLOCKS * BLOCK).unwrap());
            let map = volumes.mapping(VOLUME).unwrap();
            Self::open(drives, map, volumes)
        }

        fn open(drives: Vec<SimDrive>, map: Arc<VolumeMap>, volumes: Volumes) -> Self {
            let latches = Arc::new(DriveLatches::new(DRIVES));
            let (engine, handle, _) =
                block_on(LogEngine::open(drives.clone(), config(), latches)).unwrap();
            Self { drives, engine, handle, map, _volumes: volumes }
        }

        /// A clean restart: every segment written so far is sealed afterwards.
        fn restart(self) -> Self {
            let Self { drives, engine, handle, map, _volumes } = self;
            drop(handle);
            drop(engine);
            Self::open(drives, map, _volumes)
        }

        /// Writes blocks `first..first + count` in writes of 16 blocks.
        fn write(&self, first: u64, count: u64, tag: u64) {
            for start in (first..first + count).step_by(16) {
                let blocks = 16.min(first + count - start);
                let mut buf = AlignedBuf::new((blocks * BLOCK) as usize);
                for (number, block) in (start..).zip(buf.chunks_mut(BLOCK_BYTES)) {
                    fill_block(block, VOLUME, number, tag);
                }
                block_on(self.handle.write_blocks(&self.map, start * BLOCK, &buf)).unwrap();
            }
        }

        /// The location of `block` of the volume and the drive holding it.
        fn place(&self, block: u64) -> (u32, u16, u64) {
            let (location, _) = unpack(self.engine.lookup(VOLUME.0, block)).unwrap();
            self.place_location(location)
        }

        fn place_location(&self, location: u32) -> (u32, u16, u64) {
            let geometry = self.engine.geometry();
            let (segment, position) = geometry.split(location);
            let (drive, offset_bytes) = geometry.place(segment, position);
            (location, drive, offset_bytes)
        }

        /// Overwrites one position on its drive behind the engine's back.
        fn damage(&self, location: u32) {
            let (_, drive, offset_bytes) = self.place_location(location);
            let mut garbage = AlignedBuf::new(BLOCK_BYTES);
            garbage.fill(0x5a);
            let (result, _) =
                block_on(self.drives[usize::from(drive)].write_at(offset_bytes, garbage));
            result.unwrap();
        }

        /// Live blocks (every layer's) the index maps into sealed segments.
        fn live_in_sealed(&self) -> u32 {
            let engine = &*self.engine;
            let mut count = 0;
            for layer in engine.index.volumes() {
                layer.for_each_mapped(|_, entry| {
                    if let Some((location, _)) = unpack(entry) {
                        let segment = engine.segment_of(location);
                        count += u32::from(engine.segments.state(segment) == SegmentState::Sealed);
                    }
                });
            }
            count
        }

        /// Steps until a pass completes; every step verifies at most `blocks_max` blocks.
        fn scrub_pass(&self, cursor: &mut ScrubCursor, blocks_max: u32) -> (ScrubProgress, u32) {
            let mut total = ScrubProgress::default();
            for steps in 1..=STEPS_MAX {
                let step = block_on(self.handle.scrub_step(cursor, blocks_max)).unwrap();
                assert!(step.blocks_verified + step.blocks_damaged <= blocks_max, "{step:?}");
                total.blocks_verified += step.blocks_verified;
                total.blocks_damaged += step.blocks_damaged;
                total.chains_damaged += step.chains_damaged;
                if step.pass_completed {
                    total.pass_completed = true;
                    return (total, steps);
                }
            }
            panic!("no pass completed in {STEPS_MAX} steps");
        }
    }

    #[test]
    fn an_empty_log_completes_a_pass_at_once() {
        let node = Node::format();
        let mut cursor = ScrubCursor::new();
        let (total, steps) = node.scrub_pass(&mut cursor, 16);
        assert_eq!((total.blocks_verified, total.blocks_damaged, steps), (0, 0, 1));
        assert_eq!(cursor.passes_completed(), 1);
        assert_eq!(node.engine.stats().scrub_passes, 1);
    }

    #[test]
    fn a_pass_verifies_every_live_block_of_every_layer() {
        let node = Node::format();
        node.write(0, 200, 1);
        node.write(0, 40, 2);
        block_on(node.handle.snapshot_volume(VOLUME.0, 100)).unwrap();
        // The snapshot keeps the old blocks 0..20; the volume's new layer holds the new ones.
        node.write(0, 20, 3);
        let node = node.restart();
        let live = node.live_in_sealed();
        assert_eq!(live, 220);
        assert_eq!(node.engine.stats().mapped_bytes, 220 * BLOCK);
        let mut cursor = ScrubCursor::new();
        let (total, _) = node.scrub_pass(&mut cursor, 1000);
        assert_eq!(
            (total.blocks_verified, total.blocks_damaged, total.chains_damaged),
            (live, 0, 0)
        );
        let stats = node.engine.stats();
        assert_eq!(stats.scrub_blocks_verified, u64::from(live));
        assert_eq!((stats.scrub_errors, stats.scrub_passes, stats.checksum_errors), (0, 1, 0));
        assert!(node.engine.scrub_findings().is_empty());
    }

    #[test]
    fn a_damaged_block_is_found_and_its_reads_still_fail() {
        let node = Node::format();
        node.write(0, 100, 1);
        let node = node.restart();
        let (location, drive, _) = node.place(37);
        node.damage(location);
        let mut cursor = ScrubCursor::new();
        let (total, _) = node.scrub_pass(&mut cursor, 1000);
        assert_eq!((total.blocks_verified, total.blocks_damaged, total.chains_damaged), (99, 1, 0));
        let expected = ScrubFinding {
            damage: ScrubDamage::Block { label: VOLUME.0, block: 37 },
            location,
            drive,
            pass: 1,
            repaired: false,
        };
        assert_eq!(node.engine.scrub_findings(), vec![expected]);
        let stats = node.engine.stats();
        assert_eq!((stats.scrub_errors, stats.checksum_errors), (1, 0), "scrub_errors only");
        // Scrub repairs nothing without a second copy: the read still fails loudly.
        let buf = AlignedBuf::new(BLOCK_BYTES);
        let (result, _) = block_on(node.handle.read_blocks(&node.map, 37 * BLOCK, buf));
        match result {
            Err(LogError::ChecksumMismatch { volume, block, location: at, drive: on }) => {
                assert_eq!((volume, block, at, on), (VOLUME.0, 37, location, drive));
            }
            other => panic!("expected a checksum mismatch, got {other:?}"),
        }
        // The next pass finds it again: counted again, listed once with the later pass.
        let (total, _) = node.scrub_pass(&mut cursor, 1000);
        assert_eq!(total.blocks_damaged, 1);
        assert_eq!(node.engine.scrub_findings(), vec![ScrubFinding { pass: 2, ..expected }]);
        assert_eq!(node.engine.stats().scrub_errors, 2);
    }

    #[test]
    fn a_damaged_block_overwritten_since_is_not_reported() {
        let node = Node::format();
        node.write(0, 100, 1);
        let node = node.restart();
        let (location, _, _) = node.place(37);
        node.damage(location);
        node.write(37, 1, 2);
        let node = node.restart();
        assert_ne!(node.place(37).0, location);
        let mut cursor = ScrubCursor::new();
        let (total, _) = node.scrub_pass(&mut cursor, 1000);
        assert_eq!((total.blocks_verified, total.blocks_damaged), (100, 0));
        assert!(node.engine.scrub_findings().is_empty());
        assert_eq!(node.engine.stats().scrub_errors, 0);
    }

    #[test]
    fn blocks_max_bounds_each_step_and_passes_wrap() {
        let node = Node::format();
        node.write(0, 100, 1);
        let node = node.restart();
        let mut cursor = ScrubCursor::new();
        let (first, steps) = node.scrub_pass(&mut cursor, 7);
        assert_eq!(first.blocks_verified, 100);
        assert!(steps >= 100u32.div_ceil(7), "{steps} steps");
        let (second, _) = node.scrub_pass(&mut cursor, 7);
        assert_eq!(second.blocks_verified, 100);
        assert_eq!(cursor.passes_completed(), 2);
        assert_eq!(cursor.segment(), 0);
        let stats = node.engine.stats();
        assert_eq!((stats.scrub_blocks_verified, stats.scrub_passes), (200, 2));
    }

    #[test]
    fn a_header_chain_that_ends_before_live_blocks_is_reported() {
        let node = Node::format();
        node.write(0, 100, 1);
        let node = node.restart();
        let engine = &*node.engine;
        let geometry = *engine.geometry();
        let (location, _, _) = node.place(0);
        let (segment, position) = geometry.split(location);
        let read = |at: u32| {
            let block = block_on(node.handle.read_positions(segment, at, 1)).unwrap();
            BatchHeader::decode(&block, &geometry, segment, at).unwrap()
        };
        // Block 0 is the first of its batch; damage the header of the batch after it.
        let first = read(position - 1);
        let next = position - 1 + geometry.padded(first.positions());
        assert_eq!(read(next).segment_seq, first.segment_seq, "a second batch follows");
        let mut beyond_units = 0;
        let mut beyond_blocks = 0;
        engine.index.get(VOLUME.0).unwrap().for_each_mapped(|_, entry| {
            let (at, _) = unpack(entry).unwrap();
            if geometry.split(at).0 == segment && geometry.split(at).1 > next {
                beyond_units += entry_units(entry);
                beyond_blocks += 1;
            }
        });
        assert!(beyond_blocks > 0);
        let header_location = geometry.location(segment, next);
        node.damage(header_location);
        let mut cursor = ScrubCursor::new();
        let (total, _) = node.scrub_pass(&mut cursor, 1000);
        assert_eq!((total.blocks_verified, total.chains_damaged), (100 - beyond_blocks, 1));
        let finding = ScrubFinding {
            damage: ScrubDamage::HeaderChain { segment, live_units_unreachable: beyond_units },
            location: header_location,
            drive: geometry.place(segment, next).0,
            pass: 1,
            repaired: false,
        };
        assert_eq!(engine.scrub_findings(), vec![finding]);
        assert_eq!(engine.stats().scrub_errors, 1);
    }

    #[test]
    fn compressed_blocks_are_unpacked_and_checked() {
        let node = Node::format();
        // Two compressible blocks packed in one slot, committed as the write path would.
        let mut scratch = CompressScratch::new();
        let mut pack = PackBuilder::new();
        let mut entries = Vec::new();
        for block in 0..2u64 {
            let data = [block as u8 + 1; BLOCK_BYTES];
            let crc = crc32c::crc32c(&data);
            let compressed = compress_block(Compression::Lz4, &data, &mut scratch).unwrap();
            let cells_log2 = cells_log2_for(compressed.len()).unwrap();
            let sub = pack.try_add(Compression::Lz4, compressed, crc).unwrap();
            let kind = EntryKind::Packed { crc, cells_log2, sub, opens: sub == 0 };
            entries.push(Entry { volume: VOLUME.0, block, kind });
        }
        let mut slot = [0u8; BLOCK_BYTES];
        pack.finish(&mut slot);
        block_on(node.handle.commit_batch(Stream::Host, entries, &slot, 1)).unwrap();
        // Raw writes after it fill its segment, which is then sealed.
        node.write(10, 64, 1);
        let (slot_location, _, _) = node.place(0);
        assert_eq!(node.place(1).0, slot_location, "both blocks are in one slot");
        let slot_segment = node.engine.segment_of(slot_location);
        assert_eq!(node.engine.segments.state(slot_segment), SegmentState::Sealed);
        let live = node.live_in_sealed();
        let mut cursor = ScrubCursor::new();
        let (total, _) = node.scrub_pass(&mut cursor, 1000);
        assert_eq!(
            (total.blocks_verified, total.blocks_damaged, total.chains_damaged),
            (live, 0, 0)
        );
        node.damage(slot_location);
        let (total, _) = node.scrub_pass(&mut cursor, 1000);
        assert_eq!((total.blocks_verified, total.blocks_damaged), (live - 2, 2));
        let damaged: Vec<(ScrubDamage, u32)> = node
            .engine
            .scrub_findings()
            .iter()
            .map(|finding| (finding.damage, finding.location))
            .collect();
        let expected: Vec<(ScrubDamage, u32)> = (0..2)
            .map(|block| (ScrubDamage::Block { label: VOLUME.0, block }, slot_location))
            .collect();
        assert_eq!(damaged, expected);
    }
}
