//! Formatting a node's drives for the log, and opening them again: validating every drive's
//! superblock, loading the newest checkpoint, and replaying the batches written after it.
//!
//! Recovery reads a bounded amount: the two root slots of each drive, the checkpoint (24 bytes
//! per mapped block), the first block of every segment (to learn its sequence number), and the
//! headers and data of the segments opened since the checkpoint's floor (at most
//! `checkpoint_interval_segments` or a quarter of the segments in use, plus the open ones). The
//! data of those segments is read to verify every block's CRC, so a batch torn by the crash is
//! dropped whole with the batches behind it in its segment (none was acknowledged: a batch is
//! acknowledged only once it and every earlier batch of its handle are durable). A batch whose
//! data fails although it was durable before the crash (the checkpoint covers it, or more
//! batches follow it than can be unfinished at once: [`UNFINISHED_BATCHES_MAX`]) is damage of
//! the media, not a tear: it is kept, its bad blocks read as errors, and the walk goes on.
//!
//! The reads are few and large: the first blocks of the segments are read [`PROBES_IN_FLIGHT`]
//! at a time, and a replayed segment's batches are walked from windows of up to
//! [`WINDOW_POSITIONS`] positions read at once, not with a read for each header and another for
//! each batch's data (a chain of small reads that took about 49 ms per segment of 24 MiB of
//! data on this project's virtual disk, against 26-34 ms from windows; session 30).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use types::AlignedBuf;

use super::engine::{
    CheckpointRecord, DriveSet, LocalFuture, LogEngine, LogHandle, COMMITS_IN_FLIGHT_MAX,
    GROUP_BATCHES_MAX,
};
use super::format::{
    decode_checkpoint_block, decode_layer_block, BatchHeader, CheckpointEntry, DataSlots,
    EntryKind, Geometry, LayerRecordEntry, LogSuperblock, Root, BLOCK_BYTES,
    CHECKPOINT_ENTRIES_PER_BLOCK_MAX, LOG_HEADER_BYTES, ROOT_BLOCKS_MAX, ROOT_SLOT_BLOCKS,
    SUPERBLOCK_BLOCK, TOMBSTONE_LOCATION,
};
use super::index::{entry_units, pack, unpack, VolumeIndex, TOMBSTONE};
use super::segments::SegmentState;
use super::{LogConfig, LogError};
use crate::compress::unpack as unpack_slot;
use crate::drive::Drive;
use crate::join::join_all;
use crate::latches::DriveLatches;

/// What recovery read and rebuilt; for logs and the recovery benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub checkpoint_id: u64,
    pub checkpoint_entries: u64,
    pub segments_probed: u32,
    pub segments_replayed: u32,
    pub batches_replayed: u64,
    /// Batches found whole but older than the checkpoint, so skipped.
    pub batches_skipped: u64,
    /// Batches whose data failed its CRC and that the crash may have torn (fewer than
    /// [`UNFINISHED_BATCHES_MAX`] batches follow them in their segment), dropped with the
    /// batches behind them.
    pub batches_torn: u64,
    /// Whole batches dropped because a torn batch precedes them in their segment: they were in
    /// flight with it, so not acknowledged.
    pub batches_dropped: u64,
    /// Batches whose data failed its CRC although they were durable before the crash (the
    /// checkpoint covers them, or [`UNFINISHED_BATCHES_MAX`] batches follow them): damage, not
    /// a tear. They are kept, so reads of their bad blocks fail as on any damaged block, and
    /// the batches behind them are replayed.
    pub batches_damaged: u64,
    /// Coded logs: data and header cells of kept batches that were torn by the crash, rebuilt
    /// from parity and written back in place.
    pub blocks_repaired: u64,
    pub bytes_read: u64,
    pub mapped_blocks: u64,
    /// Drives whose superblock could not be read, left latched failed (coded logs only).
    pub drives_unusable: u16,
}

/// Reads `blocks` blocks of drive `drive_index` from `offset_bytes`.
async fn read_blocks<D: Drive>(
    drive: &D,
    drive_index: u16,
    offset_bytes: u64,
    blocks: usize,
) -> Result<AlignedBuf, LogError> {
    let (result, buf) = drive.read_at(offset_bytes, AlignedBuf::new(blocks * BLOCK_BYTES)).await;
    result.map_err(|source| LogError::Io { drive: drive_index, source })?;
    Ok(buf)
}

/// Whether recovery replays the segment opened with `seq`.
fn replayed(root: &Root, seq: u64) -> bool {
    seq >= root.segment_seq_floor || root.open_seqs.contains(&seq)
}

impl LogEngine {
    /// Formats the drives for the log: a log superblock and an empty checkpoint root on each,
    /// and the rest of the log area punched so no header of an earlier format survives.
    pub async fn format<D: Drive>(drives: &[D], config: &LogConfig) -> Result<Geometry, LogError> {
        let drive_count = u16::try_from(drives.len()).unwrap_or(u16::MAX);
        let size_bytes = drives.iter().map(Drive::size_bytes).min().unwrap_or(0);
        let geometry = Geometry::coded(
            drive_count,
            size_bytes,
            config.unit_bytes,
            config.area_offset_bytes,
            config.erasure,
        )
        .map_err(|source| LogError::SuperblockInvalid { drive: 0, source })?
        .with_header_key(config.header_key);
        let empty = Root {
            checkpoint_id: 1,
            lsn_floor: 1,
            segment_seq_floor: 1,
            lsn_next: 1,
            segment_seq_next: 1,
            entry_count: 0,
            entry_blocks: 0,
            layer_record_count: 0,
            segments: Vec::new(),
            open_seqs: Vec::new(),
        };
        for (index, drive) in drives.iter().enumerate() {
            let drive_index = index as u16;
            let io = |source| LogError::Io { drive: drive_index, source };
            let area_bytes =
                LOG_HEADER_BYTES + geometry.unit_bytes() * u64::from(geometry.segment_count);
            if !config.area_zeroed {
                drive.punch_hole(geometry.area_offset_bytes, area_bytes).await.map_err(io)?;
            }
            let superblock = LogSuperblock {
                node_uuid: config.node_uuid,
                drive_index,
                geometry,
                rebuilding: false,
            };
            let blocks = [
                (SUPERBLOCK_BLOCK, superblock.encode().to_vec()),
                (ROOT_SLOT_BLOCKS[1], empty.encode()),
            ];
            for (block, bytes) in blocks {
                let mut buf = AlignedBuf::new(bytes.len());
                buf.copy_from_slice(&bytes);
                let (result, _) = drive.write_at(geometry.header_offset_bytes(block), buf).await;
                result.map_err(io)?;
            }
            drive.sync().await.map_err(io)?;
        }
        Ok(geometry)
    }

    /// Opens formatted drives: checks them, recovers the index, and returns the engine with a
    /// first handle over these drives (for the calling thread).
    pub async fn open<D: Drive>(
        drives: Vec<D>,
        config: LogConfig,
        latches: Arc<DriveLatches>,
    ) -> Result<(Arc<LogEngine>, LogHandle<D>, RecoveryReport), LogError> {
        let mut report = RecoveryReport::default();
        let mut geometry: Option<Geometry> = None;
        // Drives whose superblock cannot be read or decoded: a coded log opens without up to
        // its parity count of them (latched failed), anything else refuses to open.
        let mut unusable: Vec<(u16, LogError)> = Vec::new();
        let mut rebuilding: Vec<u16> = Vec::new();
        for (index, drive) in drives.iter().enumerate() {
            let drive_index = index as u16;
            let offset_bytes = config.area_offset_bytes + SUPERBLOCK_BLOCK * BLOCK_BYTES as u64;
            let block = match read_blocks(drive, drive_index, offset_bytes, 1).await {
                Ok(block) => block,
                Err(error) => {
                    unusable.push((drive_index, error));
                    continue;
                }
            };
            report.bytes_read += BLOCK_BYTES as u64;
            let superblock = match LogSuperblock::decode(&block) {
                Ok(superblock) => superblock,
                Err(source) => {
                    unusable.push((
                        drive_index,
                        LogError::SuperblockInvalid { drive: drive_index, source },
                    ));
                    continue;
                }
            };
            if superblock.node_uuid != config.node_uuid {
                return Err(LogError::NodeMismatch {
                    drive: drive_index,
                    found: superblock.node_uuid,
                    expected: config.node_uuid,
                });
            }
            let same_geometry = geometry.is_none_or(|first| first == superblock.geometry);
            if superblock.drive_index != drive_index
                || !same_geometry
                || usize::from(superblock.geometry.drive_count) != drives.len()
            {
                return Err(LogError::DriveMismatch {
                    drive: drive_index,
                    found: superblock.drive_index,
                });
            }
            if superblock.rebuilding {
                rebuilding.push(drive_index);
            }
            geometry = Some(superblock.geometry);
        }
        let Some(geometry) = geometry else {
            return Err(unusable
                .into_iter()
                .next()
                .map_or(LogError::RootMissing, |(_, error)| error));
        };
        let tolerated = usize::from(geometry.parity_shards);
        if !unusable.is_empty() && (unusable.len() + rebuilding.len() > tolerated) {
            return Err(unusable
                .into_iter()
                .next()
                .map_or(LogError::RootMissing, |(_, error)| error));
        }
        if rebuilding.len() > 1 || (rebuilding.len() == 1 && tolerated == 0) {
            return Err(LogError::ReplaceRefused {
                drive: rebuilding[0],
                reason: format!("drives {rebuilding:?} are all marked as being rebuilt"),
            });
        }
        for (drive, _) in &unusable {
            latches.latch(*drive);
        }
        report.drives_unusable = unusable.len() as u16;
        let engine = Arc::new(LogEngine::new(geometry, config, latches)?);
        if let Some(drive) = rebuilding.first() {
            engine.resume_rebuild(*drive);
        }
        let handle = engine.handle(drives);
        handle.recover(&mut report).await?;
        Ok((engine, handle, report))
    }
}

/// A batch header as [`LogHandle::read_header`] finds it, with its block if it was rebuilt.
type ProbedHeader = (BatchHeader, Option<AlignedBuf>);

/// The most batches of one segment's header chain that can be unfinished at once: a handle
/// has at most [`COMMITS_IN_FLIGHT_MAX`] pipelined batches in flight, whose slots free only as
/// they install, in LSN order; a grouped round writes at most [`GROUP_BATCHES_MAX`] before its
/// sync; and a failed or abandoned batch seals its segment. So a batch followed in its chain by
/// this many others had completed before the crash, durable: if its data fails its CRC, that is
/// damage of the media, not a tear, and dropping the batches behind it would lose acknowledged
/// writes.
pub const UNFINISHED_BATCHES_MAX: usize = COMMITS_IN_FLIGHT_MAX;
const _: () = assert!(GROUP_BATCHES_MAX <= UNFINISHED_BATCHES_MAX);

/// A batch of a replayed segment's chain, walked but not yet kept.
struct Walked {
    header: BatchHeader,
    /// Its header block, if that was rebuilt from parity.
    rebuilt: Option<AlignedBuf>,
    /// Its data failed and the crash may have torn it.
    suspect: bool,
}

/// Segments whose first header recovery reads at once.
const PROBES_IN_FLIGHT: usize = 64;
/// Positions of a replayed segment recovery reads at once (8 MiB): a segment's batches are
/// walked from this window instead of with two reads each (header, then data).
const WINDOW_POSITIONS: u32 = 2048;

/// The positions of one segment recovery read last, from which it walks that segment's
/// batches. Recovery writes back only cells of batches it has walked past, so the window never
/// serves bytes it has since changed.
#[derive(Default)]
struct Window {
    segment: u32,
    first: u32,
    count: u32,
    buf: Option<AlignedBuf>,
    bytes_read: u64,
}

impl Window {
    /// Positions `first..first + count` of `segment`, from the window, which moves to start at
    /// `first` (up to [`WINDOW_POSITIONS`] or the segment's end) when they are not all in it.
    /// Where that larger read fails, only the positions asked for are read, so a bad block
    /// beyond what the log needs fails nothing.
    async fn blocks<D: Drive>(
        &mut self,
        handle: &LogHandle<D>,
        segment: u32,
        first: u32,
        count: u32,
    ) -> Result<&[u8], LogError> {
        let held = self.buf.is_some()
            && self.segment == segment
            && first >= self.first
            && first + count <= self.first + self.count;
        if !held {
            if let Some(buf) = self.buf.take() {
                handle.recycle(buf);
            }
            let per_segment = handle.engine.geometry.positions_per_segment();
            assert!(first + count <= per_segment, "a batch lies within its segment");
            let wide = count.max(WINDOW_POSITIONS.min(per_segment - first));
            let (buf, read) = match handle.read_positions(segment, first, wide).await {
                Ok(buf) => (buf, wide),
                Err(_) if wide > count => {
                    (handle.read_positions(segment, first, count).await?, count)
                }
                Err(error) => return Err(error),
            };
            self.bytes_read += u64::from(read) * BLOCK_BYTES as u64;
            (self.segment, self.first, self.count, self.buf) = (segment, first, read, Some(buf));
        }
        let buf = self.buf.as_ref().expect("the window holds the positions asked for");
        let at = (first - self.first) as usize * BLOCK_BYTES;
        Ok(&buf[at..at + count as usize * BLOCK_BYTES])
    }
}

impl<D: Drive> LogHandle<D> {
    /// True if every data block of the batch holds what its entries say: a raw block its CRC,
    /// a pack slot every compressed block named in it (each unpacked and checked). A batch cut
    /// short by a crash fails this and ends its segment's log.
    fn batch_is_whole(&self, header: &BatchHeader, data: &[u8]) -> bool {
        let mut slots = DataSlots::default();
        let mut compress = self.compress.borrow_mut();
        let mut out = [0u8; BLOCK_BYTES];
        header.entries.iter().all(|entry| {
            let Some(slot) = slots.next(&entry.kind) else { return true };
            let at = slot as usize * BLOCK_BYTES;
            let Some(block) = data.get(at..at + BLOCK_BYTES) else { return false };
            match entry.kind {
                EntryKind::Data { crc } | EntryKind::Relocated { crc, .. } => {
                    crc32c::crc32c(block) == crc
                }
                EntryKind::Packed { crc, sub, .. }
                | EntryKind::RelocatedPacked { crc, sub, .. } => {
                    <&[u8; BLOCK_BYTES]>::try_from(block)
                        .ok()
                        .and_then(|slot| unpack_slot(slot, sub, &mut out, &mut compress).ok())
                        == Some(crc)
                }
                _ => true,
            }
        })
    }

    /// The batch header at `position` of `segment`, if one is there, and the header block if it
    /// had to be rebuilt. On a coded log a header that does not decode is rebuilt from its stripe
    /// without its own drive before giving up: its cell may be torn by a crash or stale (a drive
    /// that failed and came back) while the batch is whole.
    async fn read_header(
        &self,
        segment: u32,
        position: u32,
    ) -> Result<Option<ProbedHeader>, LogError> {
        let geometry = self.engine.geometry;
        let block = self.read_positions(segment, position, 1).await?;
        let decoded = BatchHeader::decode(&block, &geometry, segment, position);
        self.recycle(block);
        if let Ok(header) = decoded {
            return Ok(Some((header, None)));
        }
        Ok(self
            .rebuilt_header(segment, position)
            .await
            .map(|(header, block)| (header, Some(block))))
    }

    /// Coded logs: the batch header at `position` of `segment` rebuilt from its stripe without
    /// the drive its cell is on, and the rebuilt block; None if that does not decode either (or
    /// the log has no parity). GC and recovery use it when the cell itself does not decode.
    pub(super) async fn rebuilt_header(
        &self,
        segment: u32,
        position: u32,
    ) -> Option<(BatchHeader, AlignedBuf)> {
        let geometry = self.engine.geometry;
        if !geometry.is_coded() {
            return None;
        }
        let mut exclude = DriveSet::default();
        exclude.insert(geometry.drive_row(position).0);
        // Counted only if it rebuilt a header: recovery tries it where each segment's header
        // chain ends, which on a healthy log is a position never written (GC and the scrub
        // only where a header they expect does not decode).
        let block = self.read_stripes_counted(segment, position, 1, exclude, false).await.ok()?;
        let header = BatchHeader::decode(&block, &geometry, segment, position).ok()?;
        self.engine.counters.reconstructed_reads.fetch_add(1, Ordering::Relaxed);
        Some((header, block))
    }

    /// Coded logs: the header of the batch of `segment`'s use with sequence `seq` at `position`,
    /// rebuilt from its stripe, for a header cell that does not decode (torn by a crash that
    /// recovery repaired through parity, or on a drive that came back stale); None where no batch
    /// of that use starts there, or without parity. GC and the scrub walk on with it.
    pub(super) async fn rebuilt_header_of(
        &self,
        segment: u32,
        seq: u64,
        position: u32,
    ) -> Option<BatchHeader> {
        let (header, rebuilt) = self.rebuilt_header(segment, position).await?;
        self.recycle(rebuilt);
        (header.segment_seq == seq).then_some(header)
    }

    /// Coded logs: whether a batch whose data failed its checksums is whole once the cells of
    /// one drive are rebuilt from parity instead of read (that drive's cells may be stale). If
    /// so and `write_back`, the rebuilt cells are written back in place, so host reads find
    /// them whole and need no parity; the count of cells written back is returned. A
    /// write-back that fails latches its drive and leaves the batch whole through parity.
    ///
    /// Only batches the checkpoint does not cover are written back: a crash can tear only
    /// those (a covered batch was durable before the checkpoint was taken), so a bad cell in a
    /// covered batch is damage, which the scrub finds, reports and repairs.
    async fn batch_is_whole_rebuilt(&self, header: &BatchHeader, write_back: bool) -> Option<u64> {
        let geometry = self.engine.geometry;
        let first = header.position + 1;
        let count = header.data_blocks();
        for drive in 0..geometry.drive_count {
            let mut exclude = DriveSet::default();
            exclude.insert(drive);
            let Ok(data) = self.read_stripes(header.segment, first, count, exclude).await else {
                continue;
            };
            if !self.batch_is_whole(header, &data) {
                continue;
            }
            if !write_back {
                return Some(0);
            }
            let mut repaired = 0;
            for (index, block) in data.chunks_exact(BLOCK_BYTES).enumerate() {
                let (on, offset_bytes) = geometry.place(header.segment, first + index as u32);
                if on != drive {
                    continue;
                }
                let mut cell = AlignedBuf::new(BLOCK_BYTES);
                cell.copy_from_slice(block);
                if self.write_cell(drive, offset_bytes, cell).await {
                    repaired += 1;
                }
            }
            return Some(repaired);
        }
        None
    }

    /// Keeps the held batches of a chain that can no longer be torn by the crash: all of them
    /// while none is suspect, and a suspect one once [`UNFINISHED_BATCHES_MAX`] batches follow
    /// it (counted damaged). Keeping writes back a header cell rebuilt from parity (if the
    /// checkpoint does not cover the batch, as for torn data cells) and queues the batch for
    /// replay, or skips it if the checkpoint covers it. What follows a suspect batch stays held.
    async fn keep_settled(
        &self,
        root: &Root,
        held: &mut Vec<Walked>,
        batches: &mut BTreeMap<u64, BatchHeader>,
        report: &mut RecoveryReport,
    ) -> Result<(), LogError> {
        let mut settled = held.len();
        while let Some(first) = held.iter().position(|walked| walked.suspect) {
            if held.len() - first - 1 < UNFINISHED_BATCHES_MAX {
                settled = first;
                break;
            }
            held[first].suspect = false;
            report.batches_damaged += 1;
        }
        assert!(held.len() <= UNFINISHED_BATCHES_MAX + 1, "a suspect batch settles in time");
        for walked in held.drain(..settled) {
            let header = walked.header;
            let uncovered = header.lsn >= root.lsn_floor;
            if let Some(block) = walked.rebuilt {
                // The batch is kept but its header cell does not decode: a crash tore it
                // (write it back, as torn data cells are, so GC and the scrub can walk the
                // segment's headers) or it is damage in a covered batch (the scrub's).
                if uncovered {
                    let (drive, offset_bytes) =
                        self.engine.geometry.place(header.segment, header.position);
                    if self.write_cell(drive, offset_bytes, block).await {
                        report.blocks_repaired += 1;
                    }
                }
            }
            if !uncovered {
                report.batches_skipped += 1;
                continue;
            }
            let (segment, position) = (header.segment, header.position);
            if batches.insert(header.lsn, header).is_some() {
                return Err(LogError::SegmentCorrupt {
                    segment,
                    position,
                    reason: "two batches carry the same LSN",
                    live_blocks: 0,
                });
            }
        }
        Ok(())
    }

    async fn recover(&self, report: &mut RecoveryReport) -> Result<(), LogError> {
        let engine = &*self.engine;
        let geometry = engine.geometry;
        let per_segment = geometry.positions_per_segment();

        // 1. The newest valid root on any drive.
        let mut root: Option<Root> = None;
        for index in 0..geometry.drive_count {
            if engine.latches.is_failed(index) {
                continue;
            }
            let drive = self.drive(index);
            for slot in ROOT_SLOT_BLOCKS {
                // The whole slot: a root spans up to ROOT_BLOCKS_MAX blocks.
                let offset_bytes = geometry.header_offset_bytes(slot);
                let read = read_blocks(&*drive, index, offset_bytes, ROOT_BLOCKS_MAX).await;
                let block = match read {
                    Ok(block) => block,
                    // A coded log reads the root from the drives that answer.
                    Err(_) if geometry.is_coded() => continue,
                    Err(error) => return Err(error),
                };
                report.bytes_read += (ROOT_BLOCKS_MAX * BLOCK_BYTES) as u64;
                if let Ok(found) = Root::decode(&block, &geometry) {
                    if root.as_ref().is_none_or(|best| found.checkpoint_id > best.checkpoint_id) {
                        root = Some(found);
                    }
                }
            }
        }
        let Some(root) = root else { return Err(LogError::RootMissing) };
        report.checkpoint_id = root.checkpoint_id;

        // 2. The checkpoint.
        let mut is_checkpoint = vec![false; geometry.segment_count as usize];
        for segment in &root.segments {
            if std::mem::replace(&mut is_checkpoint[*segment as usize], true) {
                return Err(LogError::CheckpointInvalid {
                    checkpoint_id: root.checkpoint_id,
                    reason: "the root lists a segment twice",
                });
            }
            engine.segments.claim(*segment, SegmentState::Checkpoint);
        }
        let entry_blocks = root.entry_blocks;
        let block_count = root.checkpoint_blocks();
        let mut layer_records: Vec<LayerRecordEntry> = Vec::new();
        let mut entries: Vec<CheckpointEntry> =
            Vec::with_capacity(CHECKPOINT_ENTRIES_PER_BLOCK_MAX);
        let mut loaded = 0u64;
        let mut layer: Option<Arc<VolumeIndex>> = None;
        let mut block_index = 0u64;
        while block_index < block_count {
            let segment = root.segments[(block_index / u64::from(per_segment)) as usize];
            let first = (block_index % u64::from(per_segment)) as u32;
            let count = (u64::from(per_segment - first)).min(block_count - block_index) as u32;
            let blocks = self.read_positions(segment, first, count).await?;
            report.bytes_read += u64::from(count) * BLOCK_BYTES as u64;
            for (offset, block) in blocks.chunks(BLOCK_BYTES).enumerate() {
                let index = block_index + offset as u64;
                let corrupt = |source| LogError::CheckpointCorrupt {
                    checkpoint_id: root.checkpoint_id,
                    block: index,
                    source,
                };
                if index >= entry_blocks {
                    decode_layer_block(block, root.checkpoint_id, index as u32, &mut layer_records)
                        .map_err(corrupt)?;
                    continue;
                }
                entries.clear();
                decode_checkpoint_block(
                    block,
                    &geometry,
                    root.checkpoint_id,
                    index as u32,
                    &mut entries,
                )
                .map_err(corrupt)?;
                for entry in &entries {
                    // Entries come in runs of one layer: look it up once per run.
                    let volume = match &layer {
                        Some(index) if index.volume() == entry.volume => Arc::clone(index),
                        _ => engine.index.get_or_create(entry.volume),
                    };
                    let value = if entry.location == TOMBSTONE_LOCATION {
                        TOMBSTONE
                    } else {
                        pack(entry.location, entry.tag)
                    };
                    volume.swap(entry.block, value);
                    loaded += 1;
                    layer = Some(volume);
                }
            }
            block_index += u64::from(count);
        }
        if layer_records.len() as u64 != root.layer_record_count {
            return Err(LogError::CheckpointInvalid {
                checkpoint_id: root.checkpoint_id,
                reason: "its layer blocks hold fewer records than the root records",
            });
        }
        engine.index.load_layers(super::gc::layer_table(&layer_records));
        if loaded != root.entry_count {
            return Err(LogError::CheckpointInvalid {
                checkpoint_id: root.checkpoint_id,
                reason: "its blocks hold fewer entries than the root records",
            });
        }
        report.checkpoint_entries = loaded;

        // 3. Probe every other segment's first header, PROBES_IN_FLIGHT at a time (and only
        // that many held, whatever the segment count); replay the recent ones.
        let mut seqs: Vec<Option<u64>> = vec![None; geometry.segment_count as usize];
        let mut lsn_seen = 0u64;
        let mut seq_seen = 0u64;
        let mut batches: BTreeMap<u64, BatchHeader> = BTreeMap::new();
        let mut window = Window::default();
        let mut group: Vec<u32> = Vec::with_capacity(PROBES_IN_FLIGHT);
        let mut segments = (0..geometry.segment_count).filter(|s| !is_checkpoint[*s as usize]);
        loop {
            group.clear();
            group.extend(segments.by_ref().take(PROBES_IN_FLIGHT));
            if group.is_empty() {
                break;
            }
            let reads: Vec<LocalFuture<'_, Result<Option<ProbedHeader>, LogError>>> =
                group.iter().map(|segment| Box::pin(self.read_header(*segment, 0)) as _).collect();
            let probed = join_all(reads).await;
            for (&segment, first) in group.iter().zip(probed) {
                let first = first?;
                report.segments_probed += 1;
                report.bytes_read += BLOCK_BYTES as u64;
                let Some((first, first_rebuilt)) = first else {
                    continue;
                };
                seqs[segment as usize] = Some(first.segment_seq);
                seq_seen = seq_seen.max(first.segment_seq);
                lsn_seen = lsn_seen.max(first.lsn);
                if !replayed(&root, first.segment_seq) {
                    continue;
                }
                report.segments_replayed += 1;
                let mut header = first;
                let mut rebuilt = first_rebuilt;
                // The batches walked since the oldest one whose data failed and could still be
                // torn by the crash: at most UNFINISHED_BATCHES_MAX + 1.
                let mut held: Vec<Walked> = Vec::with_capacity(UNFINISHED_BATCHES_MAX + 1);
                loop {
                    let data_blocks = header.data_blocks();
                    let next = header.position + geometry.padded(header.positions());
                    let covered = header.lsn < root.lsn_floor;
                    let mut whole = true;
                    if data_blocks > 0 {
                        let data =
                            window.blocks(self, segment, header.position + 1, data_blocks).await?;
                        whole = self.batch_is_whole(&header, data);
                        if !whole && geometry.is_coded() {
                            let rebuilt = self.batch_is_whole_rebuilt(&header, !covered).await;
                            if let Some(repaired) = rebuilt {
                                whole = true;
                                report.blocks_repaired += repaired;
                            }
                        }
                    }
                    lsn_seen = lsn_seen.max(header.lsn);
                    // The checkpoint covers a batch only once it was durable: its data failing
                    // is damage, never a tear, and the chain goes on behind it.
                    if !whole && covered {
                        report.batches_damaged += 1;
                    }
                    held.push(Walked {
                        header,
                        rebuilt: rebuilt.take(),
                        suspect: !whole && !covered,
                    });
                    self.keep_settled(&root, &mut held, &mut batches, report).await?;
                    if next >= per_segment {
                        break;
                    }
                    // From the window when it decodes there; else read again, which on a coded log
                    // also tries the cell rebuilt from its stripe.
                    let block = window.blocks(self, segment, next, 1).await?;
                    let found = match BatchHeader::decode(block, &geometry, segment, next) {
                        Ok(found) => Some((found, None)),
                        Err(_) => {
                            report.bytes_read += BLOCK_BYTES as u64;
                            self.read_header(segment, next).await?
                        }
                    };
                    match found {
                        Some((found, found_rebuilt))
                            if found.segment_seq == seqs[segment as usize].unwrap_or(0) =>
                        {
                            header = found;
                            rebuilt = found_rebuilt;
                        }
                        _ => break,
                    }
                }
                // The chain ends with fewer than UNFINISHED_BATCHES_MAX batches behind the
                // oldest suspect one: it may be torn by the crash. It is dropped with every
                // batch behind it, none of which was acknowledged.
                if !held.is_empty() {
                    debug_assert!(held[0].suspect, "keep_settled keeps what precedes a suspect");
                    report.batches_torn += 1;
                    report.batches_dropped += held.len() as u64 - 1;
                    held.clear();
                }
            }
        }
        report.bytes_read += window.bytes_read;
        if let Some(buf) = window.buf.take() {
            self.recycle(buf);
        }
        for header in batches.values() {
            engine.apply(header, false);
            report.batches_replayed += 1;
        }

        // 4. Live counts and segment states from the index.
        let mut live = vec![0u32; geometry.segment_count as usize];
        let mut mapped = 0u64;
        let mut mapped_units = 0u64;
        for volume in engine.index.volumes() {
            volume.for_each_mapped(|_, entry| {
                if let Some((location, _)) = unpack(entry) {
                    let units = entry_units(entry);
                    live[engine.segment_of(location) as usize] += units;
                    mapped += 1;
                    mapped_units += u64::from(units);
                }
            });
        }
        for segment in 0..geometry.segment_count {
            let index = segment as usize;
            if is_checkpoint[index] {
                if live[index] > 0 {
                    return Err(LogError::CheckpointInvalid {
                        checkpoint_id: root.checkpoint_id,
                        reason: "an index entry points into a checkpoint segment",
                    });
                }
                continue;
            }
            let recent = seqs[index].is_some_and(|seq| replayed(&root, seq));
            if live[index] == 0 && !recent {
                continue;
            }
            engine.segments.claim(segment, SegmentState::Sealed);
            engine.segments.set_seq(segment, seqs[index].unwrap_or(0));
            engine.segments.add_live(segment, live[index]);
        }
        for header in batches.values() {
            engine.segments.note_lsn(header.segment, header.lsn);
        }
        engine.counters.mapped_blocks.store(mapped, Ordering::Release);
        engine.counters.mapped_units.store(mapped_units, Ordering::Release);
        engine.lsn_next.store(root.lsn_next.max(lsn_seen + 1), Ordering::SeqCst);
        engine.segment_seq_next.store(root.segment_seq_next.max(seq_seen + 1), Ordering::SeqCst);
        engine.gc_seq_floor.store(root.segment_seq_floor, Ordering::Release);
        *engine.gc_excluded_seqs.lock().unwrap_or_else(|e| e.into_inner()) = root.open_seqs.clone();
        let replayed_segments = u32::try_from(
            seqs.iter().filter(|seq| seq.is_some_and(|seq| replayed(&root, seq))).count(),
        )
        .unwrap_or(u32::MAX);
        engine.sealed_since_checkpoint.store(replayed_segments, Ordering::Release);
        *engine.checkpoint.lock().unwrap_or_else(|e| e.into_inner()) =
            CheckpointRecord { id: root.checkpoint_id, segments: root.segments.clone() };
        report.mapped_blocks = mapped;
        Ok(())
    }
}
