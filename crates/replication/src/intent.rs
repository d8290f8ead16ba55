//! The write intent: which regions of the volume may hold a write this node applied that is not
//! yet known to be on every in-sync replica, kept durable so that a restarted process still
//! knows its divergence (crate docs, "Write intent"), like the write-intent bitmap of md RAID.
//!
//! [`IntentSet`] decides; the wiring persists what [`crate::Action::PersistIntent`] carries, a
//! [`WriteIntent`], whose file format is here too ([`WriteIntent::to_bytes`]). A write whose
//! data may be uncommitted is issued only once every region it touches is in every intent that
//! may be durable: the last persisted one and, while a persist is in flight, the one being
//! written (a crash may leave either). Regions wanted while a persist is in flight go into the
//! next one (group commit: at most one in flight). Regions leave lazily, on a tick at most once
//! per `intent_linger_ms`, once nothing uncommitted and no write in flight is left in them and
//! they have not been wanted for that long; leaving never makes a write wait.
//!
//! Hot path: `covered` and `want` run for every write that needs the intent; they look up the
//! one or two regions the write touches in hash sets and allocate only when a region joins.
//! Whatever leaves the set in order (a persist's ranges, a shrink) sorts first.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Range;

use foldhash::fast::RandomState;

use crate::message::ranges_canonical;
use crate::volume::Action;
use crate::{Config, Stats, INTENT_RANGES_MAX};

/// What a node's write intent says, as [`crate::Action::PersistIntent`] asks the wiring to make
/// durable and [`crate::VolumeNode::new`] takes back after a restart. Its file format is
/// [`WriteIntent::to_bytes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteIntent {
    /// The newest epoch in which this node started a term as primary (0: none known).
    pub term_epoch: u64,
    /// `Some(ranges)`: every block that may hold a write not on every in-sync replica is in
    /// these LBA ranges (canonical: sorted, none empty, none touching the next; at most
    /// [`INTENT_RANGES_MAX`]). `None`: any block may (unknown; a return needs a full copy).
    pub lbas: Option<Vec<Range<u64>>>,
}

/// What may be durable: the term epoch and the regions (`None`: unknown, every region).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    term_epoch: u64,
    regions: Option<HashSet<u64, RandomState>>,
}

impl Snapshot {
    fn holds(&self, region: u64) -> bool {
        self.regions.as_ref().is_none_or(|regions| regions.contains(&region))
    }
}

/// One node's write intent for one volume.
#[derive(Debug)]
pub(crate) struct IntentSet {
    region_blocks: u64,
    regions_max: usize,
    linger_ms: u64,
    volume_blocks: u64,
    /// The regions the next persist holds, each with when a write last wanted it.
    members: HashMap<u64, u64, RandomState>,
    /// More regions were wanted than `regions_max`: persists say unknown until a shrink finds
    /// that the regions still needed fit again.
    overflow: bool,
    term_epoch: u64,
    /// What the last completed persist made durable (or what the process started with).
    durable: Snapshot,
    /// The persist in flight: its version and what it writes.
    in_flight: Option<(u64, Snapshot)>,
    next_version: u64,
    /// A region was wanted that the newest persist lacks, or the term epoch moved: persist as
    /// soon as none is in flight.
    urgent: bool,
    last_shrink_ms: Option<u64>,
}

impl IntentSet {
    /// The intent of a process starting with what an earlier one persisted (`None`: nothing,
    /// which reads as unknown). Every region a persisted range touches stays until a shrink
    /// finds it no longer needed.
    pub fn new(config: &Config, persisted: Option<&WriteIntent>) -> Self {
        let mut set = Self {
            region_blocks: config.intent_region_blocks,
            regions_max: config.intent_regions_max,
            linger_ms: config.intent_linger_ms,
            volume_blocks: config.volume_blocks,
            members: HashMap::default(),
            overflow: false,
            term_epoch: persisted.map_or(0, |intent| intent.term_epoch),
            durable: Snapshot { term_epoch: 0, regions: None },
            in_flight: None,
            next_version: 1,
            urgent: false,
            last_shrink_ms: None,
        };
        assert!(set.region_blocks > 0 && set.regions_max > 0 && set.volume_blocks > 0);
        let Some(intent) = persisted else {
            return set;
        };
        set.durable.term_epoch = intent.term_epoch;
        let Some(ranges) = &intent.lbas else {
            return set;
        };
        // Only regions the file covers whole count as durable (it may have been written with
        // another region size); every region it touches is needed.
        let mut covered = HashSet::default();
        'ranges: for range in ranges {
            for region in set.regions(range.clone()) {
                if set.members.len() == set.regions_max && !set.members.contains_key(&region) {
                    set.overflow = true;
                    set.members.clear();
                    covered.clear();
                    break 'ranges;
                }
                set.members.insert(region, 0);
                let lbas = set.region_lbas(region);
                if range.start <= lbas.start && lbas.end <= range.end {
                    covered.insert(region);
                }
            }
        }
        set.durable.regions = Some(covered);
        set
    }

    /// The regions `lbas` touches, within the volume.
    fn regions(&self, lbas: Range<u64>) -> Range<u64> {
        let end = lbas.end.min(self.volume_blocks);
        if lbas.start >= end {
            return 0..0;
        }
        lbas.start / self.region_blocks..(end - 1) / self.region_blocks + 1
    }

    /// The LBAs of one region (the last one of the volume may be short).
    fn region_lbas(&self, region: u64) -> Range<u64> {
        let start = region.saturating_mul(self.region_blocks);
        start..start.saturating_add(self.region_blocks).min(self.volume_blocks)
    }

    /// The volume grew to `volume_blocks`. A persisted intent lists the old last region only
    /// as far as the old end, so when that region was short it no longer counts as held: a
    /// write there waits for a persist that lists it whole.
    pub fn grow(&mut self, volume_blocks: u64) {
        assert!(volume_blocks >= self.volume_blocks, "volumes only grow");
        if self.volume_blocks % self.region_blocks != 0 {
            let short = self.volume_blocks / self.region_blocks;
            let snapshots =
                std::iter::once(&mut self.durable).chain(self.in_flight.as_mut().map(|(_, s)| s));
            for snapshot in snapshots {
                if let Some(regions) = &mut snapshot.regions {
                    regions.remove(&short);
                }
            }
        }
        self.volume_blocks = volume_blocks;
    }

    /// What will be durable once the persist in flight completes.
    fn latest(&self) -> &Snapshot {
        self.in_flight.as_ref().map_or(&self.durable, |(_, snapshot)| snapshot)
    }

    /// Whether every region of `lbas` is in every intent that may be durable now.
    pub fn covered(&self, lbas: Range<u64>) -> bool {
        self.regions(lbas).all(|region| {
            self.durable.holds(region)
                && self.in_flight.as_ref().is_none_or(|(_, snapshot)| snapshot.holds(region))
        })
    }

    /// A write that may be uncommitted will touch `lbas`: its regions join the intent.
    pub fn want(&mut self, lbas: Range<u64>, now_ms: u64) {
        for region in self.regions(lbas) {
            if let Some(last_ms) = self.members.get_mut(&region) {
                *last_ms = now_ms;
            } else if self.members.len() < self.regions_max {
                self.members.insert(region, now_ms);
            } else {
                self.overflow = true;
            }
            if !self.latest().holds(region) {
                self.urgent = true;
            }
        }
    }

    /// This node started a term in `epoch`: persist it, so that a restart can still say so.
    pub fn set_term_epoch(&mut self, epoch: u64) {
        assert!(epoch >= self.term_epoch);
        self.term_epoch = epoch;
        if self.latest().term_epoch != epoch {
            self.urgent = true;
        }
    }

    /// What the next persist writes. `divergence_lost`: this node's divergence lost marks,
    /// which may lie anywhere, so the intent is unknown until they resolve.
    fn target(&self, divergence_lost: bool) -> Snapshot {
        let regions = (!divergence_lost && !self.overflow)
            .then(|| self.members.keys().copied().collect::<HashSet<u64, RandomState>>());
        Snapshot { term_epoch: self.term_epoch, regions }
    }

    /// Issues the next persist if a write waits for one and none is in flight.
    pub fn flush(&mut self, divergence_lost: bool, stats: &mut Stats, out: &mut Vec<Action>) {
        if self.urgent && self.in_flight.is_none() {
            let target = self.target(divergence_lost);
            self.issue(target, stats, out);
        }
    }

    /// Issues a persist of the intent as it stands, unless one is in flight; returns its
    /// version. The primary's storage probe (crate docs, "Writes").
    pub fn probe(
        &mut self,
        divergence_lost: bool,
        stats: &mut Stats,
        out: &mut Vec<Action>,
    ) -> Option<u64> {
        if self.in_flight.is_some() {
            return None;
        }
        let version = self.next_version;
        self.issue(self.target(divergence_lost), stats, out);
        Some(version)
    }

    fn issue(&mut self, target: Snapshot, stats: &mut Stats, out: &mut Vec<Action>) {
        assert!(self.in_flight.is_none(), "at most one persist in flight");
        let version = self.next_version;
        self.next_version += 1;
        self.urgent = false;
        stats.intent_persists += 1;
        let lbas = target.regions.as_ref().map(|regions| self.lba_ranges(regions));
        let intent = WriteIntent { term_epoch: target.term_epoch, lbas };
        self.in_flight = Some((version, target));
        out.push(Action::PersistIntent { version, intent });
    }

    /// Regions as canonical LBA ranges: consecutive regions make one range.
    fn lba_ranges(&self, regions: &HashSet<u64, RandomState>) -> Vec<Range<u64>> {
        let mut sorted: Vec<u64> = regions.iter().copied().collect();
        sorted.sort_unstable();
        let mut ranges: Vec<Range<u64>> = Vec::new();
        for region in sorted {
            let lbas = self.region_lbas(region);
            match ranges.last_mut() {
                Some(last) if last.end == lbas.start => last.end = lbas.end,
                _ => ranges.push(lbas),
            }
        }
        assert!(ranges.len() <= INTENT_RANGES_MAX && ranges_canonical(&ranges));
        ranges
    }

    /// A persist completed; true if it was the one in flight.
    pub fn on_persisted(&mut self, version: u64) -> bool {
        match self.in_flight.take() {
            Some((expected, snapshot)) if expected == version => {
                self.durable = snapshot;
                true
            }
            other => {
                self.in_flight = other;
                false
            }
        }
    }

    /// Whether a shrink may run now: none in flight, and none in the last linger period.
    pub fn shrink_due(&self, now_ms: u64) -> bool {
        self.in_flight.is_none()
            && self.last_shrink_ms.is_none_or(|last_ms| last_ms + self.linger_ms <= now_ms)
    }

    /// Drops the regions nothing needs any more: `needed` lists the LBAs that may hold
    /// uncommitted data or have a write in flight (unresolved divergence marks, pending host
    /// writes, storage writes in flight); a region outside them leaves once unwanted for the
    /// linger period. Persists the result if it differs from what is durable.
    pub fn shrink(
        &mut self,
        now_ms: u64,
        needed: impl Iterator<Item = Range<u64>>,
        divergence_lost: bool,
        stats: &mut Stats,
        out: &mut Vec<Action>,
    ) {
        assert!(self.shrink_due(now_ms));
        self.last_shrink_ms = Some(now_ms);
        let mut needed_regions = BTreeSet::new();
        let mut fits = true;
        'ranges: for range in needed {
            for region in self.regions(range) {
                needed_regions.insert(region);
                if needed_regions.len() > self.regions_max {
                    fits = false;
                    break 'ranges;
                }
            }
        }
        if fits {
            let mut members: HashMap<u64, u64, RandomState> = needed_regions
                .into_iter()
                .map(|region| (region, self.members.get(&region).copied().unwrap_or(now_ms)))
                .collect();
            // Lingering regions join lowest first, so which stay when they do not all fit
            // does not depend on the hash.
            let mut lingering: Vec<(u64, u64)> =
                self.members.iter().map(|(&region, &last_ms)| (region, last_ms)).collect();
            lingering.sort_unstable();
            for (region, last_ms) in lingering {
                if members.len() == self.regions_max {
                    break;
                }
                if last_ms + self.linger_ms > now_ms {
                    members.entry(region).or_insert(last_ms);
                }
            }
            self.members = members;
            self.overflow = false;
        } else {
            self.overflow = true;
        }
        let target = self.target(divergence_lost);
        if target != self.durable {
            self.issue(target, stats, out);
        }
    }
}

/// The first bytes of a write-intent file ("Ferrite replication write intent").
pub const INTENT_FILE_MAGIC: [u8; 4] = *b"FRWI";
/// The version [`WriteIntent::to_bytes`] writes and the only one [`WriteIntent::from_bytes`]
/// reads.
pub const INTENT_FILE_VERSION: u8 = 1;
/// Bytes of the file before its ranges.
pub const INTENT_FILE_HEADER_BYTES: usize = 24;
/// Bytes of one range: its first LBA and its block count.
const INTENT_FILE_RANGE_BYTES: usize = 16;
/// The longest file: the header and `INTENT_RANGES_MAX` ranges.
pub const INTENT_FILE_BYTES_MAX: usize =
    INTENT_FILE_HEADER_BYTES + INTENT_RANGES_MAX * INTENT_FILE_RANGE_BYTES;
const INTENT_UNKNOWN: u8 = 0;
const INTENT_KNOWN: u8 = 1;
/// Where the checksum sits; it covers the bytes before it and the ranges.
const INTENT_CHECKSUM_AT: usize = 20;

/// Why bytes are not a write-intent file. The node then starts as if it had none (`None`),
/// which is safe: a return needs a full copy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntentFileError {
    #[error(
        "the write-intent file holds {length_bytes} bytes; a file holds {INTENT_FILE_HEADER_BYTES} \
         plus {INTENT_FILE_RANGE_BYTES} per range, at most {INTENT_FILE_BYTES_MAX}"
    )]
    LengthInvalid { length_bytes: usize },
    #[error("the file does not start with the write-intent magic \"FRWI\"")]
    MagicWrong,
    #[error(
        "write-intent file version {version} is not supported: this node reads only version \
         {INTENT_FILE_VERSION}"
    )]
    VersionUnsupported { version: u8 },
    #[error("write-intent file checksum mismatch: it carries {stored:#010x}, bytes hash to {computed:#010x}")]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error("invalid field at byte {offset} of the write-intent file: {reason}")]
    FieldInvalid { offset: usize, reason: &'static str },
}

impl WriteIntent {
    /// The file the wiring writes (atomically: a new file, fsync, rename, fsync of the
    /// directory) for `Action::PersistIntent`. Layout (docs/replication-wire.md, "Write-intent
    /// file"), little-endian:
    ///
    /// ```text
    /// 0       4     5      6        8            16            20         24
    /// +-------+-----+------+--------+------------+-------------+----------+-- ... --+
    /// | magic | ver | kind | zero   | term_epoch | range_count | checksum | ranges  |
    /// | FRWI  | u8  | u8   | u16    | u64        | u32         | u32      |         |
    /// +-------+-----+------+--------+------------+-------------+----------+-- ... --+
    /// ```
    ///
    /// `kind` 0 is unknown (no ranges), 1 known; each range is its first LBA (u64) and its
    /// block count (u64), canonical. `checksum` is the CRC-32C of bytes `0..20` and the ranges.
    pub fn to_bytes(&self) -> Vec<u8> {
        let ranges: &[Range<u64>] = self.lbas.as_deref().unwrap_or(&[]);
        assert!(ranges.len() <= INTENT_RANGES_MAX && ranges_canonical(ranges));
        let mut out =
            Vec::with_capacity(INTENT_FILE_HEADER_BYTES + ranges.len() * INTENT_FILE_RANGE_BYTES);
        out.extend_from_slice(&INTENT_FILE_MAGIC);
        out.push(INTENT_FILE_VERSION);
        out.push(if self.lbas.is_some() { INTENT_KNOWN } else { INTENT_UNKNOWN });
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.term_epoch.to_le_bytes());
        out.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        for range in ranges {
            out.extend_from_slice(&range.start.to_le_bytes());
            out.extend_from_slice(&(range.end - range.start).to_le_bytes());
        }
        let checksum = intent_checksum(&out);
        out[INTENT_CHECKSUM_AT..INTENT_FILE_HEADER_BYTES].copy_from_slice(&checksum.to_le_bytes());
        out
    }

    /// Reads a file [`WriteIntent::to_bytes`] wrote, checking everything before it allocates.
    pub fn from_bytes(bytes: &[u8]) -> Result<WriteIntent, IntentFileError> {
        let length_bytes = bytes.len();
        let length_valid = (INTENT_FILE_HEADER_BYTES..=INTENT_FILE_BYTES_MAX)
            .contains(&length_bytes)
            && (length_bytes - INTENT_FILE_HEADER_BYTES) % INTENT_FILE_RANGE_BYTES == 0;
        if bytes.len() >= 4 && bytes[..4] != INTENT_FILE_MAGIC {
            return Err(IntentFileError::MagicWrong);
        }
        if let Some(&version) = bytes.get(4) {
            if version != INTENT_FILE_VERSION {
                return Err(IntentFileError::VersionUnsupported { version });
            }
        }
        if !length_valid {
            return Err(IntentFileError::LengthInvalid { length_bytes });
        }
        let stored = le_u32(bytes, INTENT_CHECKSUM_AT);
        let computed = intent_checksum(bytes);
        if stored != computed {
            return Err(IntentFileError::ChecksumMismatch { stored, computed });
        }
        let field = |offset, reason| IntentFileError::FieldInvalid { offset, reason };
        if bytes[6..8] != [0, 0] {
            return Err(field(6, "reserved bytes are not zero"));
        }
        let term_epoch = le_u64(bytes, 8);
        let count = le_u32(bytes, 16) as usize;
        if INTENT_FILE_HEADER_BYTES + count * INTENT_FILE_RANGE_BYTES != length_bytes {
            return Err(field(16, "range count does not match the file length"));
        }
        let lbas = match bytes[5] {
            INTENT_UNKNOWN if count == 0 => None,
            INTENT_UNKNOWN => return Err(field(16, "an unknown intent holds no ranges")),
            INTENT_KNOWN => {
                let mut ranges: Vec<Range<u64>> = Vec::with_capacity(count);
                for index in 0..count {
                    let at = INTENT_FILE_HEADER_BYTES + index * INTENT_FILE_RANGE_BYTES;
                    let (lba, blocks) = (le_u64(bytes, at), le_u64(bytes, at + 8));
                    if blocks == 0 {
                        return Err(field(at, "empty range"));
                    }
                    let Some(end) = lba.checked_add(blocks) else {
                        return Err(field(at, "range runs past the last LBA"));
                    };
                    if ranges.last().is_some_and(|last| last.end >= lba) {
                        return Err(field(at, "range not after the previous one"));
                    }
                    ranges.push(lba..end);
                }
                Some(ranges)
            }
            _ => return Err(field(5, "unknown kind")),
        };
        Ok(WriteIntent { term_epoch, lbas })
    }
}

/// CRC-32C of the file without its checksum field.
fn intent_checksum(bytes: &[u8]) -> u32 {
    let head = crc32c::crc32c(&bytes[..INTENT_CHECKSUM_AT]);
    crc32c::crc32c_append(head, &bytes[INTENT_FILE_HEADER_BYTES..])
}

fn le_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn le_u64(bytes: &[u8], at: usize) -> u64 {
    let mut array = [0; 8];
    array.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(array)
}

const _: () = assert!(INTENT_CHECKSUM_AT + 4 == INTENT_FILE_HEADER_BYTES);
const _: () = assert!(INTENT_RANGES_MAX <= u32::MAX as usize);

#[cfg(test)]
// A list of one LBA range is what these tests mean, not a range collected into a list.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    /// 64 blocks in regions of 4; at most 4 regions; linger 100 ms.
    fn config() -> Config {
        Config {
            volume_blocks: 64,
            intent_region_blocks: 4,
            intent_regions_max: 4,
            intent_linger_ms: 100,
            ..Config::default()
        }
    }

    /// The persists `out` asks for: (version, LBA ranges or unknown).
    fn persists(out: &mut Vec<Action>) -> Vec<(u64, Option<Vec<Range<u64>>>)> {
        std::mem::take(out)
            .into_iter()
            .map(|action| match action {
                Action::PersistIntent { version, intent } => (version, intent.lbas),
                other => panic!("only intent persists expected: {other:?}"),
            })
            .collect()
    }

    /// A write that wants `lbas` at `now_ms`: whether it may go at once.
    fn intend(set: &mut IntentSet, lbas: Range<u64>, now_ms: u64, out: &mut Vec<Action>) -> bool {
        set.want(lbas.clone(), now_ms);
        set.flush(false, &mut Stats::default(), out);
        set.covered(lbas)
    }

    /// A set whose durable intent is known and empty (the first shrink of a new node).
    fn started() -> IntentSet {
        let mut set = IntentSet::new(&config(), None);
        assert!(set.covered(0..64), "nothing persisted reads as unknown");
        let mut out = Vec::new();
        set.shrink(0, std::iter::empty(), false, &mut Stats::default(), &mut out);
        assert_eq!(persists(&mut out), vec![(1, Some(vec![]))]);
        assert!(set.on_persisted(1));
        assert!(!set.covered(0..1));
        set
    }

    #[test]
    fn a_short_last_region_is_held_again_only_after_a_persist_lists_it_whole() {
        // 62 blocks in regions of 4: the last region, 60..62, is short.
        let config = Config { volume_blocks: 62, ..config() };
        let mut set = IntentSet::new(&config, None);
        let mut out = Vec::new();
        set.shrink(0, std::iter::empty(), false, &mut Stats::default(), &mut out);
        assert_eq!(persists(&mut out), vec![(1, Some(vec![]))]);
        assert!(set.on_persisted(1));
        assert!(!intend(&mut set, 60..62, 1, &mut out));
        assert_eq!(persists(&mut out), vec![(2, Some(vec![60..62]))]);
        assert!(set.on_persisted(2));
        assert!(set.covered(60..62));

        set.grow(64);
        // The durable file lists 60..62 only: neither the old nor the new blocks of the
        // region count as held until a persist lists 60..64.
        assert!(!set.covered(62..64));
        assert!(!set.covered(60..61));
        assert!(!intend(&mut set, 62..64, 2, &mut out));
        assert_eq!(persists(&mut out), vec![(3, Some(vec![60..64]))]);
        assert!(set.on_persisted(3));
        assert!(set.covered(60..64));

        // Growing from a whole region keeps what is held.
        set.grow(128);
        assert!(set.covered(60..64));
        assert!(!set.covered(64..65));
    }
    #[test]
    fn a_write_waits_until_its_region_is_durable_and_then_goes_straight_through() {
        let mut set = started();
        let mut out = Vec::new();
        assert!(!intend(&mut set, 5..7, 10, &mut out));
        assert_eq!(persists(&mut out), vec![(2, Some(vec![4..8]))]);
        assert!(!set.covered(5..7), "not before the persist completes");
        assert!(!set.on_persisted(1), "an old version changes nothing");
        assert!(set.on_persisted(2));
        assert!(set.covered(5..7) && set.covered(4..8));
        // The common path: the region is durable, nothing to persist, nothing to wait for.
        assert!(intend(&mut set, 6..8, 20, &mut out));
        assert!(out.is_empty());
        assert!(!set.covered(7..9), "a write into the next region waits");
    }

    #[test]
    fn regions_wanted_during_a_persist_go_into_the_next_one_together() {
        let mut set = started();
        let mut out = Vec::new();
        assert!(!intend(&mut set, 0..1, 10, &mut out));
        assert_eq!(persists(&mut out), vec![(2, Some(vec![0..4]))]);
        for lba in [8, 9, 20, 2] {
            assert!(!intend(&mut set, lba..lba + 1, 11, &mut out));
            assert!(out.is_empty(), "at most one persist in flight");
        }
        assert!(set.on_persisted(2));
        assert!(set.covered(2..3), "block 2 was in the first persist");
        set.flush(false, &mut Stats::default(), &mut out);
        assert_eq!(persists(&mut out), vec![(3, Some(vec![0..4, 8..12, 20..24]))]);
        assert!(set.on_persisted(3));
        assert!(set.covered(8..10) && set.covered(20..21));
    }

    #[test]
    fn idle_regions_leave_lazily_unless_something_still_needs_them() {
        let mut set = started();
        let (mut out, mut stats) = (Vec::new(), Stats::default());
        assert!(!intend(&mut set, 0..1, 10, &mut out));
        assert!(!intend(&mut set, 0..1, 10, &mut out));
        persists(&mut out);
        set.on_persisted(2);
        set.flush(false, &mut stats, &mut out);
        assert!(out.is_empty());
        assert!(!intend(&mut set, 12..13, 10, &mut out));
        persists(&mut out);
        set.on_persisted(3);
        // Within the linger period no shrink runs; after it, region 3 leaves but region 0 is
        // still needed (say a divergence mark there).
        assert!(!set.shrink_due(99));
        assert!(set.shrink_due(100));
        set.shrink(100, std::iter::once(1..2), false, &mut stats, &mut out);
        assert!(out.is_empty(), "both regions were wanted less than a linger period ago");
        assert!(!set.shrink_due(150));
        set.shrink(200, std::iter::once(1..2), false, &mut stats, &mut out);
        assert_eq!(persists(&mut out), vec![(4, Some(vec![0..4]))]);
        // While the shrunk intent is in flight, a write to the dropped region waits: a crash
        // may leave either file.
        assert!(!intend(&mut set, 13..14, 210, &mut out));
        assert!(out.is_empty());
        assert!(set.on_persisted(4));
        set.flush(false, &mut stats, &mut out);
        assert_eq!(persists(&mut out), vec![(5, Some(vec![0..4, 12..16]))]);
        assert!(set.on_persisted(5));
        // Nothing needed and idle: everything leaves at the next due shrink.
        set.shrink(400, std::iter::empty(), false, &mut stats, &mut out);
        assert_eq!(persists(&mut out), vec![(6, Some(vec![]))]);
        assert_eq!(stats.intent_persists, 3, "the persists issued with these stats");
    }

    #[test]
    fn too_many_regions_or_a_lost_divergence_persist_unknown() {
        let mut set = started();
        let (mut out, mut stats) = (Vec::new(), Stats::default());
        for region in 0..4 {
            intend(&mut set, region * 4..region * 4 + 1, 10, &mut out);
        }
        assert_eq!(persists(&mut out), vec![(2, Some(vec![0..4]))]);
        set.on_persisted(2);
        set.flush(false, &mut stats, &mut out);
        assert_eq!(persists(&mut out), vec![(3, Some(vec![0..16]))]);
        set.on_persisted(3);
        // A fifth region does not fit: the intent says unknown, which covers every block.
        assert!(!intend(&mut set, 40..41, 20, &mut out));
        assert_eq!(persists(&mut out), vec![(4, None)]);
        assert!(!set.covered(40..41), "not before unknown is durable");
        set.on_persisted(4);
        assert!(set.covered(40..41) && set.covered(63..64));
        // Once what is needed fits again, a shrink persists it known.
        set.shrink(200, std::iter::once(40..41), false, &mut stats, &mut out);
        assert_eq!(persists(&mut out), vec![(5, Some(vec![40..44]))]);
        set.on_persisted(5);
        // A divergence that lost marks may hold anything: unknown until it is known again.
        set.shrink(400, std::iter::once(40..41), true, &mut stats, &mut out);
        assert_eq!(persists(&mut out), vec![(6, None)]);
        set.on_persisted(6);
        set.shrink(600, std::iter::once(40..41), false, &mut stats, &mut out);
        assert_eq!(persists(&mut out), vec![(7, Some(vec![40..44]))]);
    }

    #[test]
    fn a_restart_keeps_what_was_persisted_until_it_is_no_longer_needed() {
        // Written with regions of 2 blocks: 6..8 covers no whole region of 4, 16..24 two.
        let persisted = WriteIntent { term_epoch: 7, lbas: Some(vec![6..8, 16..24]) };
        let mut set = IntentSet::new(&config(), Some(&persisted));
        assert!(set.covered(16..24) && !set.covered(4..8) && !set.covered(0..1));
        let (mut out, mut stats) = (Vec::new(), Stats::default());
        // The restart's divergence still lists those blocks: every touched region stays.
        set.shrink(0, [6..8, 16..24].into_iter(), false, &mut stats, &mut out);
        let expected = WriteIntent { term_epoch: 7, lbas: Some(vec![4..8, 16..24]) };
        assert_eq!(
            std::mem::take(&mut out),
            vec![Action::PersistIntent { version: 1, intent: expected }]
        );
        set.on_persisted(1);
        set.set_term_epoch(9);
        set.flush(false, &mut stats, &mut out);
        let expected = WriteIntent { term_epoch: 9, lbas: Some(vec![4..8, 16..24]) };
        assert_eq!(out, vec![Action::PersistIntent { version: 2, intent: expected }]);
        // More persisted regions than fit: unknown until they are no longer needed.
        let wide = WriteIntent { term_epoch: 0, lbas: Some(vec![0..64]) };
        let mut set = IntentSet::new(&config(), Some(&wide));
        assert!(!set.covered(0..1));
        let mut out = Vec::new();
        set.shrink(0, std::iter::once(0..64), false, &mut stats, &mut out);
        assert_eq!(persists(&mut out), vec![(1, None)]);
    }

    #[test]
    fn the_file_round_trips_and_refuses_damage() {
        let intents = [
            WriteIntent { term_epoch: 0, lbas: None },
            WriteIntent { term_epoch: 3, lbas: Some(vec![]) },
            WriteIntent { term_epoch: u64::MAX, lbas: Some(vec![0..256, 512..1024]) },
            WriteIntent { term_epoch: 1, lbas: Some(vec![u64::MAX - 1..u64::MAX]) },
        ];
        for intent in &intents {
            let bytes = intent.to_bytes();
            assert_eq!(bytes.len(), 24 + 16 * intent.lbas.as_ref().map_or(0, Vec::len));
            assert_eq!(WriteIntent::from_bytes(&bytes).as_ref(), Ok(intent));
            for at in 0..bytes.len() {
                for flip in [1, 0x80, 0xFF] {
                    let mut damaged = bytes.clone();
                    damaged[at] ^= flip;
                    assert!(WriteIntent::from_bytes(&damaged).is_err(), "byte {at} ^ {flip}");
                }
            }
            for length in 0..bytes.len() {
                assert!(WriteIntent::from_bytes(&bytes[..length]).is_err(), "cut to {length}");
            }
        }
        let bytes = intents[2].to_bytes();
        assert_eq!(&bytes[..4], b"FRWI");
        assert_eq!(bytes[4], 1, "version");
        assert_eq!(bytes[5], 1, "known");
        assert_eq!(&bytes[16..20], &2u32.to_le_bytes(), "two ranges");
        assert_eq!(&bytes[24..40], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
        // Ranges that are valid bytes but not canonical are refused (checksum made right).
        let reseal = |mut bytes: Vec<u8>| {
            let checksum = intent_checksum(&bytes);
            bytes[INTENT_CHECKSUM_AT..INTENT_FILE_HEADER_BYTES]
                .copy_from_slice(&checksum.to_le_bytes());
            WriteIntent::from_bytes(&bytes)
        };
        let mut touching = bytes.clone();
        touching[40..48].copy_from_slice(&256u64.to_le_bytes());
        assert_eq!(
            reseal(touching),
            Err(IntentFileError::FieldInvalid {
                offset: 40,
                reason: "range not after the previous one"
            })
        );
        let mut empty = bytes.clone();
        empty[48..56].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(
            reseal(empty),
            Err(IntentFileError::FieldInvalid { offset: 40, reason: "empty range" })
        );
        let mut unknown_with_ranges = bytes.clone();
        unknown_with_ranges[5] = 0;
        assert_eq!(
            reseal(unknown_with_ranges),
            Err(IntentFileError::FieldInvalid {
                offset: 16,
                reason: "an unknown intent holds no ranges"
            })
        );
        let mut newer = bytes;
        newer[4] = 2;
        assert_eq!(
            WriteIntent::from_bytes(&newer),
            Err(IntentFileError::VersionUnsupported { version: 2 })
        );
    }
}
