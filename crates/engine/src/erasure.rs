//! Erasure coding across a node's drives (issue 5): which scheme a node uses, how a write batch
//! is cut into a full stripe, and the codec that computes parity and rebuilds lost shards.
//!
//! Every group-commit batch is its own full stripe of variable width, so parity is computed in RAM
//! before the write and never read-modify-written. A batch of N blocks under a `k+m` scheme uses
//! `w <= min(k, N)` data shards of `L = ceil(N / min(k, N))` blocks each; only the last data shard
//! may be shorter, and its missing tail is implicit zeros that are never written. Each of the `m`
//! parity shards has `L` blocks. Every shard goes to a distinct drive, so losing up to `m` drives
//! loses at most `m` shards of any stripe.
//!
//! The arithmetic is `reed-solomon-simd` (Leopard-RS over GF(2^16), runtime SIMD dispatch). It is
//! position-wise: byte `j` of a parity shard depends only on byte `j` of each data shard (in 64-byte
//! groups), so any range of block rows of a stripe can be rebuilt from the same rows of the
//! survivors; a degraded read of one block reads one block from each of `w` survivors. Two
//! relations of the crate's code are pinned by tests and used as fast paths, because the crate's
//! decoder has a fixed cost of about 0.3 ms per call whatever the shard size:
//! - with one data shard (a batch of one block, or a `1+m` scheme), every parity shard equals the
//!   data shard: the stripe is an (m+1)-way mirror;
//! - with one parity shard, the parity is the XOR of the data shards (the short one zero-extended).
//!
//! The parity bytes are part of the on-disk format: a test pins them for fixed input, so a crate
//! upgrade that changed the code would fail it instead of silently making old stripes
//! unrebuildable.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use reed_solomon_simd::{ReedSolomonDecoder, ReedSolomonEncoder};

/// The bytes of one block; shards are whole blocks.
pub const BLOCK_BYTES: usize = types::BLOCK_SIZE_BYTES as usize;
/// The most data shards a scheme may have.
pub const DATA_SHARDS_MAX: u8 = 16;
/// The most parity shards a scheme may have: the most drives a stripe can lose.
pub const PARITY_SHARDS_MAX: u8 = 3;
/// The most blocks one stripe (one batch) may hold; bounds the codec's scratch buffers.
pub const STRIPE_DATA_BLOCKS_MAX: u32 = 4096;
/// The scheme a node gets when none is asked for and it has enough drives.
pub const DEFAULT_SCHEME: ErasureScheme = ErasureScheme { data_shards: 4, parity_shards: 1 };

// Shard sets are u32 bitmaps over data shards then parity shards.
const _: () = assert!(DATA_SHARDS_MAX as u32 + PARITY_SHARDS_MAX as u32 <= 32);
// reed-solomon-simd works on 64-byte groups of 32 GF(2^16) symbols; whole blocks keep every row
// range of a shard aligned to those groups, which is what makes row-range rebuilds exact.
const _: () = assert!(BLOCK_BYTES % 64 == 0);

/// How many data and parity shards each stripe of a node has: `k+m`, shown as "4+1".
///
/// Valid by construction: `1 <= k <= DATA_SHARDS_MAX`, `m <= PARITY_SHARDS_MAX`. Whether it fits a
/// node's drives (`k + m <= drives`) is checked by [`ErasureScheme::check_drives`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ErasureScheme {
    data_shards: u8,
    parity_shards: u8,
}

impl ErasureScheme {
    /// No redundancy: each block is written once (a node with one drive).
    pub const NONE: ErasureScheme = ErasureScheme { data_shards: 1, parity_shards: 0 };

    pub fn new(data_shards: u8, parity_shards: u8) -> Result<ErasureScheme, ErasureError> {
        if data_shards == 0 || data_shards > DATA_SHARDS_MAX {
            return Err(ErasureError::DataShardsOutOfRange { data_shards, parity_shards });
        }
        if parity_shards > PARITY_SHARDS_MAX {
            return Err(ErasureError::ParityShardsOutOfRange { data_shards, parity_shards });
        }
        Ok(ErasureScheme { data_shards, parity_shards })
    }

    /// The scheme for a node with `drives` drives, and a sentence saying why it differs from what
    /// was asked for (or from the default) when it does.
    ///
    /// Without a request: 4+1 when the node has at least 5 drives, otherwise one parity shard and
    /// as many data shards as the other drives allow (3+1, 2+1, 1+1 = mirror), and 1+0 (none) on
    /// one drive. With a request that needs more drives than there are: the same parity with fewer
    /// data shards, or, when even that does not fit, a mirror over every drive. A request that is
    /// not a valid scheme at all is an error, not a fallback.
    pub fn for_drives(
        drives: u16,
        requested: Option<(u8, u8)>,
    ) -> Result<(ErasureScheme, Option<String>), ErasureError> {
        assert!(drives >= 1, "a node has at least one drive");
        let wanted = match requested {
            Some((data_shards, parity_shards)) => ErasureScheme::new(data_shards, parity_shards)?,
            None => DEFAULT_SCHEME,
        };
        if wanted.check_drives(drives).is_ok() {
            return Ok((wanted, None));
        }
        let scheme = if drives > u16::from(wanted.parity_shards) {
            let data_shards =
                (drives - u16::from(wanted.parity_shards)).min(u16::from(DATA_SHARDS_MAX));
            ErasureScheme { data_shards: data_shards as u8, parity_shards: wanted.parity_shards }
        } else {
            ErasureScheme { data_shards: 1, parity_shards: (drives - 1) as u8 }
        };
        assert!(scheme.check_drives(drives).is_ok());
        assert!(scheme.parity_shards <= wanted.parity_shards);
        let plural = if drives == 1 { "drive" } else { "drives" };
        let asked = if requested.is_some() { "the requested" } else { "the default" };
        let note = format!(
            "{asked} erasure coding {wanted} needs {} drives but this node has {drives} {plural}; \
             using {scheme} instead: {}",
            wanted.shards(),
            scheme.protection(),
        );
        Ok((scheme, Some(note)))
    }

    /// `k`: the most data shards a stripe has.
    pub fn data_shards(self) -> u8 {
        self.data_shards
    }

    /// `m`: the parity shards every stripe has, so the drives a stripe can lose.
    pub fn parity_shards(self) -> u8 {
        self.parity_shards
    }

    /// `k + m`: the drives a full-width stripe spans.
    pub fn shards(self) -> u8 {
        self.data_shards + self.parity_shards
    }

    /// Whether a node with `drives` drives can put each shard of a stripe on its own drive.
    pub fn check_drives(self, drives: u16) -> Result<(), ErasureError> {
        if u16::from(self.shards()) > drives {
            return Err(ErasureError::SchemeTooWide { scheme: self, drives });
        }
        Ok(())
    }

    /// A sentence on what the scheme survives, for operators.
    pub fn protection(self) -> String {
        match (self.data_shards, self.parity_shards) {
            (_, 0) => "blocks are not protected against losing a drive".to_owned(),
            (1, m) => format!("every block is mirrored on {} drives", m + 1),
            (_, 1) => "each stripe survives the loss of 1 drive".to_owned(),
            (_, m) => format!("each stripe survives the loss of {m} drives"),
        }
    }
}

impl fmt::Display for ErasureScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{}", self.data_shards, self.parity_shards)
    }
}

impl FromStr for ErasureScheme {
    type Err = ErasureError;

    /// Parses "4+1": data shards, a plus sign, parity shards.
    fn from_str(text: &str) -> Result<ErasureScheme, ErasureError> {
        let unparsable = || ErasureError::SchemeUnparsable { text: text.to_owned() };
        let (data, parity) = text.trim().split_once('+').ok_or_else(unparsable)?;
        let data_shards = data.trim().parse::<u8>().map_err(|_| unparsable())?;
        let parity_shards = parity.trim().parse::<u8>().map_err(|_| unparsable())?;
        ErasureScheme::new(data_shards, parity_shards)
    }
}

/// Where a batch's block sits in its stripe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPosition {
    /// The data shard, `0..plan.data_shards()`.
    pub shard: u8,
    /// The block's offset inside that shard, in blocks.
    pub offset_blocks: u32,
}

/// The shape of one batch's stripe: how many data shards, how long each shard is.
///
/// Invariants (asserted on construction): `1 <= data_shards <= min(k, blocks)`; every data shard
/// but the last has `shard_blocks` blocks; the last has `1..=shard_blocks`; they sum to `blocks`;
/// each parity shard has `shard_blocks` blocks. Shards are numbered data first (`0..w`), then
/// parity (`w..w + m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripePlan {
    scheme: ErasureScheme,
    blocks: u32,
    data_shards: u8,
    shard_blocks: u32,
    last_shard_blocks: u32,
}

/// The stripe of a batch of `blocks` blocks under `scheme`.
///
/// `L = ceil(N / min(k, N))` and `w = ceil(N / L)`: the fewest blocks per shard that `k` drives
/// allow, then only as many data shards as those take, so only the last can be short. (Taking
/// `w = min(k, N)` instead would leave shards empty: 5 blocks over 4 shards of 2 is 2+2+1+0.)
pub fn plan(scheme: ErasureScheme, blocks: u32) -> StripePlan {
    assert!(blocks >= 1, "a stripe holds at least one block");
    assert!(
        blocks <= STRIPE_DATA_BLOCKS_MAX,
        "a stripe holds at most {STRIPE_DATA_BLOCKS_MAX} blocks"
    );
    let widest = u32::from(scheme.data_shards).min(blocks);
    let shard_blocks = blocks.div_ceil(widest);
    let data_shards = blocks.div_ceil(shard_blocks);
    let last_shard_blocks = blocks - (data_shards - 1) * shard_blocks;
    assert!(data_shards >= 1 && data_shards <= widest);
    assert!(last_shard_blocks >= 1 && last_shard_blocks <= shard_blocks);
    StripePlan { scheme, blocks, data_shards: data_shards as u8, shard_blocks, last_shard_blocks }
}

impl StripePlan {
    pub fn scheme(&self) -> ErasureScheme {
        self.scheme
    }

    /// N: the batch's blocks.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// w: the data shards of this stripe, at most `k`.
    pub fn data_shards(&self) -> u8 {
        self.data_shards
    }

    /// m: the parity shards of this stripe (the scheme's).
    pub fn parity_shards(&self) -> u8 {
        self.scheme.parity_shards
    }

    /// w + m: the drives this stripe is written to.
    pub fn shards(&self) -> u8 {
        self.data_shards + self.scheme.parity_shards
    }

    /// L: the blocks of every data shard but the last, and of every parity shard.
    pub fn shard_blocks(&self) -> u32 {
        self.shard_blocks
    }

    /// The blocks of the last data shard, `1..=L`.
    pub fn last_shard_blocks(&self) -> u32 {
        self.last_shard_blocks
    }

    /// Every block the stripe writes: the batch's blocks plus `m * L` parity blocks.
    pub fn written_blocks(&self) -> u32 {
        self.blocks + u32::from(self.scheme.parity_shards) * self.shard_blocks
    }

    /// The blocks shard `shard` holds (data or parity).
    pub fn shard_len_blocks(&self, shard: u8) -> u32 {
        assert!(shard < self.shards(), "shard {shard} of a {}-shard stripe", self.shards());
        if shard + 1 == self.data_shards {
            self.last_shard_blocks
        } else {
            self.shard_blocks
        }
    }

    /// The blocks of shard `shard` within `rows`, a range of offsets inside shards: the short
    /// last data shard may hold fewer, or none.
    pub fn shard_rows_blocks(&self, shard: u8, rows: &Range<u32>) -> u32 {
        self.check_rows(rows);
        rows.end.min(self.shard_len_blocks(shard)).saturating_sub(rows.start)
    }

    /// Where block `block` (`0..N`) of the batch sits: shard `block / L`, offset `block % L`.
    pub fn locate(&self, block: u32) -> ShardPosition {
        assert!(block < self.blocks, "block {block} of a {}-block stripe", self.blocks);
        let position = ShardPosition {
            shard: (block / self.shard_blocks) as u8,
            offset_blocks: block % self.shard_blocks,
        };
        assert!(position.shard < self.data_shards);
        assert!(position.offset_blocks < self.shard_len_blocks(position.shard));
        position
    }

    /// The batch block at `offset_blocks` of data shard `shard`, the inverse of
    /// [`StripePlan::locate`]; `None` past the end of the shard or for a parity shard.
    pub fn block_at(&self, shard: u8, offset_blocks: u32) -> Option<u32> {
        if shard >= self.data_shards || offset_blocks >= self.shard_len_blocks(shard) {
            return None;
        }
        Some(u32::from(shard) * self.shard_blocks + offset_blocks)
    }

    fn check_rows(&self, rows: &Range<u32>) {
        assert!(
            rows.start < rows.end && rows.end <= self.shard_blocks,
            "rows {rows:?} of shards of {} blocks",
            self.shard_blocks
        );
    }
}

/// A set of a stripe's shards (data `0..w`, then parity `w..w + m`), such as those lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardSet(u32);

impl ShardSet {
    pub const EMPTY: ShardSet = ShardSet(0);

    #[must_use]
    pub fn with(self, shard: u8) -> ShardSet {
        assert!(u32::from(shard) < u32::BITS);
        ShardSet(self.0 | 1 << shard)
    }

    pub fn contains(self, shard: u8) -> bool {
        u32::from(shard) < u32::BITS && self.0 & 1 << shard != 0
    }

    pub fn count(self) -> u8 {
        self.0.count_ones() as u8
    }

    /// The set as a bitmap: bit `s` for shard `s`.
    pub fn bits(self) -> u32 {
        self.0
    }
}

impl FromIterator<u8> for ShardSet {
    fn from_iter<I: IntoIterator<Item = u8>>(shards: I) -> ShardSet {
        shards.into_iter().fold(ShardSet::EMPTY, ShardSet::with)
    }
}

/// Errors of schemes and reconstruction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ErasureError {
    #[error(
        "erasure coding {data_shards}+{parity_shards} is not supported: a stripe has 1 to {max} data shards",
        max = DATA_SHARDS_MAX
    )]
    DataShardsOutOfRange { data_shards: u8, parity_shards: u8 },
    #[error(
        "erasure coding {data_shards}+{parity_shards} is not supported: a stripe has at most {max} parity shards",
        max = PARITY_SHARDS_MAX
    )]
    ParityShardsOutOfRange { data_shards: u8, parity_shards: u8 },
    #[error(
        "erasure coding {scheme} needs {needed} drives, one per shard, but the node has {drives}",
        needed = scheme.shards()
    )]
    SchemeTooWide { scheme: ErasureScheme, drives: u16 },
    #[error("erasure coding {text:?} is not of the form DATA+PARITY, for example 4+1")]
    SchemeUnparsable { text: String },
    #[error(
        "a stripe of {data_shards} data and {parity_shards} parity shards lost {lost} shards but can \
         rebuild at most {parity_shards}: the blocks on its lost drives cannot be read"
    )]
    TooManyShardsLost { lost: u8, data_shards: u8, parity_shards: u8 },
}

/// Computes parity for stripes and rebuilds lost data shards. One per data-path thread: it keeps
/// the crate's working space and a scratch shard, grown to the largest stripe seen, so after
/// warm-up a stripe allocates nothing.
#[derive(Default)]
pub struct Encoder {
    encoder: Option<ReedSolomonEncoder>,
    decoder: Option<ReedSolomonDecoder>,
    /// The short last data shard, zero-extended to `L` blocks (the crate wants equal shards).
    scratch: Vec<u8>,
}

impl fmt::Debug for Encoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Encoder")
            .field("scratch_bytes", &self.scratch.len())
            .finish_non_exhaustive()
    }
}

impl Encoder {
    pub fn new() -> Encoder {
        Encoder::default()
    }

    /// Computes the `m` parity shards of a stripe. `data_shards[s]` holds data shard `s`
    /// (`plan.shard_len_blocks(s)` blocks, so the last may be short); each `parity_out[p]` gets
    /// parity shard `p`, `L` blocks.
    pub fn encode(
        &mut self,
        plan: &StripePlan,
        data_shards: &[&[u8]],
        parity_out: &mut [&mut [u8]],
    ) {
        assert_eq!(data_shards.len(), usize::from(plan.data_shards()));
        assert_eq!(parity_out.len(), usize::from(plan.parity_shards()));
        for (shard, data) in (0u8..).zip(data_shards) {
            assert_eq!(data.len(), plan.shard_len_blocks(shard) as usize * BLOCK_BYTES);
        }
        let shard_bytes = plan.shard_blocks() as usize * BLOCK_BYTES;
        for parity in parity_out.iter() {
            assert_eq!(parity.len(), shard_bytes);
        }
        if parity_out.is_empty() {
            return;
        }
        let (data_count, parity_count) = (data_shards.len(), parity_out.len());
        let encoder = match &mut self.encoder {
            Some(encoder) => {
                checked(encoder.reset(data_count, parity_count, shard_bytes));
                encoder
            }
            slot @ None => {
                slot.insert(checked(ReedSolomonEncoder::new(data_count, parity_count, shard_bytes)))
            }
        };
        for data in data_shards {
            if data.len() == shard_bytes {
                checked(encoder.add_original_shard(data));
            } else {
                let padded = zero_extended(&mut self.scratch, data, shard_bytes);
                checked(encoder.add_original_shard(padded));
            }
        }
        let result = checked(encoder.encode());
        for (index, parity) in parity_out.iter_mut().enumerate() {
            match result.recovery(index) {
                Some(recovery) => parity.copy_from_slice(recovery),
                None => {
                    panic!("reed-solomon-simd returned no recovery shard {index} of {parity_count}")
                }
            }
        }
    }

    /// Rebuilds the lost data shards of a stripe, over the block rows `rows` of its shards (the
    /// whole stripe is `0..L`; a degraded read of one block needs only that block's row).
    ///
    /// `shards` has one buffer per shard, data then parity, each holding that shard's blocks in
    /// `rows` (`plan.shard_rows_blocks(s, &rows)` blocks). Shards in `lost` are not read; lost data
    /// shards are overwritten with their contents, lost parity shards are left alone (and may be
    /// empty). Rebuilding needs `w` survivors: more than `m` lost shards is an error and leaves the
    /// buffers as they were. A lost parity shard is not rebuilt: re-encode the data for that.
    pub fn reconstruct(
        &mut self,
        plan: &StripePlan,
        rows: Range<u32>,
        shards: &mut [&mut [u8]],
        lost: ShardSet,
    ) -> Result<(), ErasureError> {
        let needed = self.check_reconstruct(plan, &rows, shards, lost)?;
        let Some(needed) = needed else { return Ok(()) };
        if plan.data_shards() == 1 {
            rebuild_from_mirror(plan, shards, needed);
        } else if plan.parity_shards() == 1 {
            rebuild_from_xor(plan, shards, needed);
        } else {
            self.rebuild_with_decoder(plan, &rows, shards, needed);
        }
        Ok(())
    }

    /// Checks buffers against the plan; returns the shards that must be treated as lost (data
    /// shards with no blocks in `rows` are known zeros, not lost), or `None` when no data shard with
    /// blocks in `rows` is lost.
    fn check_reconstruct(
        &self,
        plan: &StripePlan,
        rows: &Range<u32>,
        shards: &[&mut [u8]],
        lost: ShardSet,
    ) -> Result<Option<ShardSet>, ErasureError> {
        assert_eq!(shards.len(), usize::from(plan.shards()));
        assert!(lost.0 >> plan.shards() == 0, "lost {lost:?} beyond the stripe");
        let mut needed = ShardSet::EMPTY;
        let mut data_lost = false;
        for (shard, buffer) in (0u8..).zip(shards.iter()) {
            let bytes = plan.shard_rows_blocks(shard, rows) as usize * BLOCK_BYTES;
            let is_parity = shard >= plan.data_shards();
            if lost.contains(shard) && is_parity {
                assert!(buffer.is_empty() || buffer.len() == bytes);
                needed = needed.with(shard);
            } else {
                assert_eq!(buffer.len(), bytes, "shard {shard} buffer for rows {rows:?}");
                if lost.contains(shard) && bytes > 0 {
                    needed = needed.with(shard);
                    data_lost = true;
                }
            }
        }
        if !data_lost {
            return Ok(None);
        }
        if needed.count() > plan.parity_shards() {
            return Err(ErasureError::TooManyShardsLost {
                lost: needed.count(),
                data_shards: plan.data_shards(),
                parity_shards: plan.parity_shards(),
            });
        }
        Ok(Some(needed))
    }

    fn rebuild_with_decoder(
        &mut self,
        plan: &StripePlan,
        rows: &Range<u32>,
        shards: &mut [&mut [u8]],
        lost: ShardSet,
    ) {
        let shard_bytes = (rows.end - rows.start) as usize * BLOCK_BYTES;
        let (data_count, parity_count) =
            (usize::from(plan.data_shards()), usize::from(plan.parity_shards()));
        let decoder = match &mut self.decoder {
            Some(decoder) => {
                checked(decoder.reset(data_count, parity_count, shard_bytes));
                decoder
            }
            slot @ None => {
                slot.insert(checked(ReedSolomonDecoder::new(data_count, parity_count, shard_bytes)))
            }
        };
        // The crate needs exactly w shards; survivors beyond that are not copied in.
        let mut added = 0;
        for (index, shard) in shards.iter().enumerate().take(data_count) {
            if !lost.contains(index as u8) {
                if shard.len() == shard_bytes {
                    checked(decoder.add_original_shard(index, &**shard));
                } else {
                    let padded = zero_extended(&mut self.scratch, shard, shard_bytes);
                    checked(decoder.add_original_shard(index, padded));
                }
                added += 1;
            }
        }
        for (index, shard) in shards[data_count..].iter().enumerate() {
            if added < data_count && !lost.contains((data_count + index) as u8) {
                checked(decoder.add_recovery_shard(index, &**shard));
                added += 1;
            }
        }
        assert_eq!(added, data_count);
        let result = checked(decoder.decode());
        for (index, shard) in shards.iter_mut().enumerate().take(data_count) {
            if lost.contains(index as u8) {
                match result.restored_original(index) {
                    Some(restored) => shard.copy_from_slice(&restored[..shard.len()]),
                    None => {
                        panic!("reed-solomon-simd restored no data shard {index} of {data_count}")
                    }
                }
            }
        }
    }
}

/// One data shard: every parity shard is a copy of it (pinned by a test of the crate's code).
fn rebuild_from_mirror(plan: &StripePlan, shards: &mut [&mut [u8]], lost: ShardSet) {
    assert_eq!(plan.data_shards(), 1);
    assert!(lost.contains(0));
    let (data, parity) = shards.split_at_mut(1);
    let survivor = (0..plan.parity_shards()).find(|&index| !lost.contains(1 + index));
    match survivor {
        Some(index) => data[0].copy_from_slice(&parity[usize::from(index)][..data[0].len()]),
        None => panic!("a checked mirror stripe lost every copy"),
    }
}

/// One parity shard: it is the XOR of the data shards (pinned by a test of the crate's code), so
/// the one lost data shard is the XOR of the parity and the other data shards.
fn rebuild_from_xor(plan: &StripePlan, shards: &mut [&mut [u8]], lost: ShardSet) {
    assert_eq!(plan.parity_shards(), 1);
    assert_eq!(lost.count(), 1);
    let data_count = usize::from(plan.data_shards());
    let Some(target) = (0..data_count).find(|&index| lost.contains(index as u8)) else {
        panic!("no lost data shard to rebuild");
    };
    let (before, rest) = shards.split_at_mut(target);
    let (out, after) = rest.split_at_mut(1);
    let out = &mut *out[0];
    let (after_data, parity) = after.split_at(data_count - target - 1);
    out.copy_from_slice(&parity[0][..out.len()]);
    for other in before.iter().chain(after_data) {
        // A shorter shard (the last) is zero past its end, which XOR leaves alone.
        let common = other.len().min(out.len());
        xor_into(&mut out[..common], &other[..common]);
    }
}

fn xor_into(out: &mut [u8], other: &[u8]) {
    assert_eq!(out.len(), other.len());
    for (out, other) in out.iter_mut().zip(other) {
        *out ^= *other;
    }
}

/// `shard` followed by zeros up to `shard_bytes`, in the reused scratch buffer.
fn zero_extended<'a>(scratch: &'a mut Vec<u8>, shard: &[u8], shard_bytes: usize) -> &'a [u8] {
    assert!(shard.len() < shard_bytes);
    assert!(shard_bytes <= STRIPE_DATA_BLOCKS_MAX as usize * BLOCK_BYTES);
    if scratch.len() < shard_bytes {
        scratch.resize(shard_bytes, 0);
    }
    scratch[..shard.len()].copy_from_slice(shard);
    scratch[shard.len()..shard_bytes].fill(0);
    &scratch[..shard_bytes]
}

/// The crate's errors are all about counts and sizes this module has already asserted, so one is
/// a programmer error here.
fn checked<T>(result: Result<T, reed_solomon_simd::Error>) -> T {
    match result {
        Ok(value) => value,
        Err(error) => panic!("reed-solomon-simd rejected a stripe this module checked: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scheme(data_shards: u8, parity_shards: u8) -> ErasureScheme {
        ErasureScheme::new(data_shards, parity_shards).unwrap()
    }

    /// Deterministic, distinct bytes for every block of a batch.
    fn batch(blocks: u32, seed: u64) -> Vec<u8> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..blocks as usize * BLOCK_BYTES)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    }

    /// The stripe of a batch: data shards (cut by `plan.locate`) then parity shards.
    fn stripe(encoder: &mut Encoder, plan: &StripePlan, bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut data: Vec<Vec<u8>> = (0..plan.data_shards())
            .map(|s| vec![0; plan.shard_len_blocks(s) as usize * BLOCK_BYTES])
            .collect();
        for block in 0..plan.blocks() {
            let position = plan.locate(block);
            let at = position.offset_blocks as usize * BLOCK_BYTES;
            let from = block as usize * BLOCK_BYTES;
            data[usize::from(position.shard)][at..at + BLOCK_BYTES]
                .copy_from_slice(&bytes[from..from + BLOCK_BYTES]);
        }
        let mut parity = vec![
            vec![0u8; plan.shard_blocks() as usize * BLOCK_BYTES];
            usize::from(plan.parity_shards())
        ];
        let data_refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let mut parity_refs: Vec<&mut [u8]> = parity.iter_mut().map(Vec::as_mut_slice).collect();
        encoder.encode(plan, &data_refs, &mut parity_refs);
        data.extend(parity);
        data
    }

    /// Loses `lost` from rows `rows` of `shards` (garbage in their buffers), rebuilds, returns the
    /// outcome and the rebuilt rows of every shard.
    fn lose_and_rebuild(
        encoder: &mut Encoder,
        plan: &StripePlan,
        shards: &[Vec<u8>],
        rows: Range<u32>,
        lost: ShardSet,
    ) -> (Result<(), ErasureError>, Vec<Vec<u8>>) {
        let mut buffers: Vec<Vec<u8>> = (0..plan.shards())
            .map(|s| {
                let blocks = plan.shard_rows_blocks(s, &rows) as usize;
                let start = if blocks == 0 { 0 } else { rows.start as usize * BLOCK_BYTES };
                let mut buffer =
                    shards[usize::from(s)][start..start + blocks * BLOCK_BYTES].to_vec();
                if lost.contains(s) {
                    buffer.fill(0xA5);
                }
                buffer
            })
            .collect();
        let mut refs: Vec<&mut [u8]> = buffers.iter_mut().map(Vec::as_mut_slice).collect();
        let outcome = encoder.reconstruct(plan, rows, &mut refs, lost);
        (outcome, buffers)
    }

    fn expected_rows(
        plan: &StripePlan,
        shards: &[Vec<u8>],
        rows: &Range<u32>,
        shard: u8,
    ) -> Vec<u8> {
        let blocks = plan.shard_rows_blocks(shard, rows) as usize;
        let start = if blocks == 0 { 0 } else { rows.start as usize * BLOCK_BYTES };
        shards[usize::from(shard)][start..start + blocks * BLOCK_BYTES].to_vec()
    }

    fn subsets(shards: u8, size_max: u8) -> Vec<ShardSet> {
        (0u32..1 << shards)
            .filter(|bits| bits.count_ones() <= u32::from(size_max))
            .map(ShardSet)
            .collect()
    }

    const SCHEMES: [(u8, u8); 11] =
        [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (4, 1), (4, 2), (4, 3), (8, 2), (8, 3), (16, 3)];

    #[test]
    fn every_loss_of_up_to_m_shards_is_rebuilt_exactly() {
        let mut encoder = Encoder::new();
        for (k, m) in SCHEMES {
            let scheme = scheme(k, m);
            let k = u32::from(k);
            // One block, a partial width, a short last shard, an exact fit, a long stripe.
            for blocks in [1, 2, k + 1, 2 * k + 1, 3 * k, 4 * k - 1] {
                let plan = plan(scheme, blocks.clamp(1, STRIPE_DATA_BLOCKS_MAX));
                let shards = stripe(&mut encoder, &plan, &batch(plan.blocks(), u64::from(blocks)));
                let whole = 0..plan.shard_blocks();
                for lost in subsets(plan.shards(), m) {
                    let (outcome, rebuilt) =
                        lose_and_rebuild(&mut encoder, &plan, &shards, whole.clone(), lost);
                    assert_eq!(outcome, Ok(()), "{scheme} blocks {blocks} lost {lost:?}");
                    for shard in 0..plan.data_shards() {
                        assert!(
                            rebuilt[usize::from(shard)] == shards[usize::from(shard)],
                            "{scheme} blocks {blocks} lost {lost:?} shard {shard}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn more_than_m_lost_is_an_error_that_changes_nothing() {
        let mut encoder = Encoder::new();
        for (k, m) in SCHEMES.into_iter().chain([(1, 0), (4, 0)]) {
            let scheme = scheme(k, m);
            let plan = plan(scheme, 4 * u32::from(k));
            let shards = stripe(&mut encoder, &plan, &batch(plan.blocks(), 7));
            // Data shard 0 and m more shards, counted from the last (parity first).
            let lost: ShardSet =
                std::iter::once(0).chain((0..m).map(|i| plan.shards() - 1 - i)).collect();
            let (outcome, rebuilt) =
                lose_and_rebuild(&mut encoder, &plan, &shards, 0..plan.shard_blocks(), lost);
            let error = ErasureError::TooManyShardsLost {
                lost: m + 1,
                data_shards: plan.data_shards(),
                parity_shards: m,
            };
            assert_eq!(outcome, Err(error.clone()), "{scheme}");
            assert!(
                rebuilt[0].iter().all(|&byte| byte == 0xA5),
                "{scheme}: a failed rebuild wrote"
            );
            if (k, m) == (4, 2) {
                assert_eq!(
                    error.to_string(),
                    "a stripe of 4 data and 2 parity shards lost 3 shards but can rebuild at most 2: the \
                     blocks on its lost drives cannot be read"
                );
            }
        }
    }

    #[test]
    fn losing_only_parity_or_beyond_the_short_shard_needs_nothing() {
        let mut encoder = Encoder::new();
        // 4+1 over 7 blocks: shards of 2, 2, 2, 1; row 1 of the last shard is past its end.
        let plan = plan(scheme(4, 1), 7);
        assert_eq!((plan.data_shards(), plan.shard_blocks(), plan.last_shard_blocks()), (4, 2, 1));
        let shards = stripe(&mut encoder, &plan, &batch(7, 3));
        let parity_only = ShardSet::EMPTY.with(4);
        let (outcome, _) = lose_and_rebuild(&mut encoder, &plan, &shards, 0..2, parity_only);
        assert_eq!(outcome, Ok(()));
        // Row 1: the short shard holds nothing there, so losing it and shard 0 is one real loss.
        let two = ShardSet::EMPTY.with(0).with(3);
        let (outcome, rebuilt) = lose_and_rebuild(&mut encoder, &plan, &shards, 1..2, two);
        assert_eq!(outcome, Ok(()));
        assert_eq!(rebuilt[0], expected_rows(&plan, &shards, &(1..2), 0));
        assert!(rebuilt[3].is_empty());
    }

    #[test]
    fn one_block_batch_is_mirrored_into_every_parity_block() {
        let mut encoder = Encoder::new();
        for m in 1..=PARITY_SHARDS_MAX {
            for k in [1, 4, 16] {
                let plan = plan(scheme(k, m), 1);
                assert_eq!(
                    (plan.data_shards(), plan.shard_blocks(), plan.written_blocks()),
                    (1, 1, 1 + u32::from(m))
                );
                let shards = stripe(&mut encoder, &plan, &batch(1, u64::from(k)));
                for parity in &shards[1..] {
                    assert!(*parity == shards[0], "{k}+{m}: parity of one block is a copy of it");
                }
            }
        }
    }

    #[test]
    fn single_parity_is_the_xor_of_the_data_shards() {
        let mut encoder = Encoder::new();
        for k in 1..=DATA_SHARDS_MAX {
            for blocks in [u32::from(k), 3 * u32::from(k) - 1] {
                let plan = plan(scheme(k, 1), blocks);
                let shards = stripe(&mut encoder, &plan, &batch(blocks, u64::from(k)));
                let mut xor = vec![0u8; plan.shard_blocks() as usize * BLOCK_BYTES];
                for data in &shards[..usize::from(plan.data_shards())] {
                    xor_into(&mut xor[..data.len()], data);
                }
                assert!(
                    xor == shards[usize::from(plan.data_shards())],
                    "{k}+1 over {blocks} blocks"
                );
            }
        }
    }

    #[test]
    fn fast_paths_agree_with_the_crate_decoder() {
        let mut encoder = Encoder::new();
        for (k, m, blocks) in [(4, 1, 7), (8, 1, 8), (1, 2, 3), (1, 3, 1), (3, 3, 1)] {
            let plan = plan(scheme(k, m), blocks);
            let shards = stripe(&mut encoder, &plan, &batch(blocks, 11));
            let rows = 0..plan.shard_blocks();
            for lost in subsets(plan.shards(), m).into_iter().filter(|lost| lost.contains(0)) {
                let needed = lost;
                let mut fast: Vec<Vec<u8>> = shards.clone();
                let mut slow: Vec<Vec<u8>> = shards.clone();
                fast[0].fill(0);
                slow[0].fill(0);
                let mut fast_refs: Vec<&mut [u8]> =
                    fast.iter_mut().map(Vec::as_mut_slice).collect();
                let mut slow_refs: Vec<&mut [u8]> =
                    slow.iter_mut().map(Vec::as_mut_slice).collect();
                encoder.reconstruct(&plan, rows.clone(), &mut fast_refs, needed).unwrap();
                encoder.rebuild_with_decoder(&plan, &rows, &mut slow_refs, needed);
                assert!(
                    fast[0] == shards[0] && slow[0] == shards[0],
                    "{k}+{m} over {blocks} lost {lost:?}"
                );
            }
        }
    }

    /// The parity bytes are on-disk format: these CRC32Cs of 4+2 parity over a fixed batch must not
    /// change with a crate upgrade.
    #[test]
    fn parity_bytes_are_pinned() {
        let mut encoder = Encoder::new();
        let plan = plan(scheme(4, 2), 7);
        let shards = stripe(&mut encoder, &plan, &batch(7, 42));
        let digests: Vec<u32> = shards[4..].iter().map(|parity| crc32c::crc32c(parity)).collect();
        assert_eq!(digests, PINNED_PARITY_CRC32C);
    }
    const PINNED_PARITY_CRC32C: [u32; 2] = [0x653D_56CF, 0x7A85_55D5];

    #[test]
    fn plan_covers_every_block_exactly_once() {
        for (k, m) in SCHEMES.into_iter().chain([(1, 0), (5, 1), (7, 2)]) {
            let scheme = scheme(k, m);
            for blocks in 1..=300 {
                let plan = plan(scheme, blocks);
                let w = plan.data_shards();
                assert!(w >= 1 && w <= k && u32::from(w) <= blocks);
                assert_eq!(plan.shard_blocks(), blocks.div_ceil(u32::from(k).min(blocks)));
                let mut seen = vec![false; blocks as usize];
                for shard in 0..w {
                    let len = plan.shard_len_blocks(shard);
                    assert!(len >= 1 && len <= plan.shard_blocks());
                    assert!(shard + 1 == w || len == plan.shard_blocks(), "only the last is short");
                    for offset in 0..len {
                        let block = plan.block_at(shard, offset).unwrap();
                        assert!(
                            !std::mem::replace(&mut seen[block as usize], true),
                            "block {block} twice"
                        );
                        assert_eq!(
                            plan.locate(block),
                            ShardPosition { shard, offset_blocks: offset }
                        );
                    }
                    assert_eq!(plan.block_at(shard, len), None);
                }
                assert!(seen.iter().all(|&seen| seen), "{scheme} over {blocks} blocks");
                assert_eq!(plan.written_blocks(), blocks + u32::from(m) * plan.shard_blocks());
            }
        }
    }

    #[test]
    fn plan_examples() {
        // (scheme, blocks) -> (w, L, last)
        let check = |k, m, blocks, expect: (u8, u32, u32)| {
            let plan = plan(scheme(k, m), blocks);
            assert_eq!(
                (plan.data_shards(), plan.shard_blocks(), plan.last_shard_blocks()),
                expect,
                "{k}+{m} {blocks}"
            );
        };
        check(4, 1, 1, (1, 1, 1));
        check(4, 1, 3, (3, 1, 1));
        check(4, 1, 4, (4, 1, 1));
        check(4, 1, 5, (3, 2, 1));
        check(4, 1, 9, (3, 3, 3));
        check(4, 1, 10, (4, 3, 1));
        check(4, 2, 126, (4, 32, 30));
        check(1, 1, 17, (1, 17, 17));
    }

    #[test]
    fn schemes_for_drives() {
        let check = |drives, requested, expect: &str, note: Option<&str>| {
            let (scheme, why) = ErasureScheme::for_drives(drives, requested).unwrap();
            assert_eq!(scheme.to_string(), expect, "{drives} drives, {requested:?}");
            assert_eq!(why.as_deref(), note, "{drives} drives, {requested:?}");
        };
        check(8, None, "4+1", None);
        check(5, None, "4+1", None);
        check(
            4,
            None,
            "3+1",
            Some(
                "the default erasure coding 4+1 needs 5 drives but this node has 4 drives; using 3+1 \
                 instead: each stripe survives the loss of 1 drive",
            ),
        );
        check(
            3,
            None,
            "2+1",
            Some(
                "the default erasure coding 4+1 needs 5 drives but this node has 3 drives; using 2+1 \
                 instead: each stripe survives the loss of 1 drive",
            ),
        );
        check(
            2,
            None,
            "1+1",
            Some(
                "the default erasure coding 4+1 needs 5 drives but this node has 2 drives; using 1+1 \
                 instead: every block is mirrored on 2 drives",
            ),
        );
        check(
            1,
            None,
            "1+0",
            Some(
                "the default erasure coding 4+1 needs 5 drives but this node has 1 drive; using 1+0 \
                 instead: blocks are not protected against losing a drive",
            ),
        );
        check(6, Some((4, 2)), "4+2", None);
        check(
            5,
            Some((4, 2)),
            "3+2",
            Some(
                "the requested erasure coding 4+2 needs 6 drives but this node has 5 drives; using \
                 3+2 instead: each stripe survives the loss of 2 drives",
            ),
        );
        check(
            2,
            Some((4, 2)),
            "1+1",
            Some(
                "the requested erasure coding 4+2 needs 6 drives but this node has 2 drives; using \
                 1+1 instead: every block is mirrored on 2 drives",
            ),
        );
        check(3, Some((1, 2)), "1+2", None);
        check(256, Some((16, 3)), "16+3", None);
        check(4, Some((2, 0)), "2+0", None);
        assert_eq!(
            ErasureScheme::for_drives(8, Some((4, 4))).unwrap_err().to_string(),
            "erasure coding 4+4 is not supported: a stripe has at most 3 parity shards"
        );
        assert_eq!(
            ErasureScheme::for_drives(8, Some((0, 1))).unwrap_err(),
            ErasureError::DataShardsOutOfRange { data_shards: 0, parity_shards: 1 }
        );
        assert!(ErasureScheme::new(17, 1).is_err());
        assert_eq!(
            scheme(4, 2).check_drives(5).unwrap_err().to_string(),
            "erasure coding 4+2 needs 6 drives, one per shard, but the node has 5"
        );
    }

    #[test]
    fn scheme_text_round_trips() {
        assert_eq!("4+1".parse::<ErasureScheme>(), Ok(scheme(4, 1)));
        assert_eq!(" 8 + 2 ".parse::<ErasureScheme>(), Ok(scheme(8, 2)));
        assert_eq!(scheme(16, 3).to_string().parse::<ErasureScheme>(), Ok(scheme(16, 3)));
        assert!(matches!("4".parse::<ErasureScheme>(), Err(ErasureError::SchemeUnparsable { .. })));
        assert!(matches!(
            "4+x".parse::<ErasureScheme>(),
            Err(ErasureError::SchemeUnparsable { .. })
        ));
        assert!(matches!(
            "4+9".parse::<ErasureScheme>(),
            Err(ErasureError::ParityShardsOutOfRange { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Random schemes, batch sizes, data, row ranges and losses of up to m shards: the lost data
        /// rows come back exactly; one loss more is an error.
        #[test]
        fn random_losses_are_rebuilt(
            (k, m) in prop::sample::select(SCHEMES.to_vec()),
            blocks in 1u32..=300,
            seed in any::<u64>(),
            row_picks in (any::<u32>(), any::<u32>()),
            loss_picks in prop::collection::vec(any::<u8>(), 4),
        ) {
            let mut encoder = Encoder::new();
            let plan = plan(scheme(k, m), blocks);
            let shards = stripe(&mut encoder, &plan, &batch(blocks, seed));
            let (a, b) = (row_picks.0 % plan.shard_blocks(), row_picks.1 % plan.shard_blocks());
            let rows = a.min(b)..a.max(b) + 1;
            let mut lost = ShardSet::EMPTY;
            for pick in loss_picks.iter().take(usize::from(m)) {
                lost = lost.with(pick % plan.shards());
            }
            let (outcome, rebuilt) = lose_and_rebuild(&mut encoder, &plan, &shards, rows.clone(), lost);
            prop_assert_eq!(outcome, Ok(()));
            for shard in 0..plan.data_shards() {
                prop_assert!(rebuilt[usize::from(shard)] == expected_rows(&plan, &shards, &rows, shard));
            }
            // Data shard 0 (full, so it has blocks in every row range) and every parity shard.
            let too_many: ShardSet = std::iter::once(0).chain(plan.data_shards()..plan.shards()).collect();
            let (outcome, _) = lose_and_rebuild(&mut encoder, &plan, &shards, rows.clone(), too_many);
            prop_assert_eq!(
                outcome,
                Err(ErasureError::TooManyShardsLost { lost: m + 1, data_shards: plan.data_shards(), parity_shards: m })
            );
        }
    }

    /// Prints what the codec costs on this machine (run with `--release -- --nocapture`); asserts
    /// only that the rebuilt bytes are right.
    #[test]
    fn print_throughput() {
        use std::time::Instant;
        let rounds = if cfg!(debug_assertions) { 3 } else { 200 };
        let mut encoder = Encoder::new();
        for (k, m) in [(4, 1), (4, 2)] {
            for shard_blocks in [1, 8, 128] {
                let plan = plan(scheme(k, m), u32::from(k) * shard_blocks);
                let shards = stripe(&mut encoder, &plan, &batch(plan.blocks(), 5));
                let (data, parity) = shards.split_at(usize::from(k));
                let data_refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
                let mut parity_out = parity.to_vec();
                let mut parity_refs: Vec<&mut [u8]> =
                    parity_out.iter_mut().map(Vec::as_mut_slice).collect();
                let start = Instant::now();
                for _ in 0..rounds {
                    encoder.encode(&plan, &data_refs, &mut parity_refs);
                }
                let encode_us = start.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
                let lost: ShardSet = (0..m).collect();
                let mut rebuild_us = [0.0; 2];
                for (slot, rows) in [0..plan.shard_blocks(), 0..1].into_iter().enumerate() {
                    let mut buffers: Vec<Vec<u8>> = (0..plan.shards())
                        .map(|s| {
                            if lost.contains(s) {
                                vec![0; plan.shard_rows_blocks(s, &rows) as usize * BLOCK_BYTES]
                            } else {
                                expected_rows(&plan, &shards, &rows, s)
                            }
                        })
                        .collect();
                    let start = Instant::now();
                    for _ in 0..rounds {
                        let mut refs: Vec<&mut [u8]> =
                            buffers.iter_mut().map(Vec::as_mut_slice).collect();
                        encoder.reconstruct(&plan, rows.clone(), &mut refs, lost).unwrap();
                    }
                    rebuild_us[slot] = start.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
                    assert!(buffers[0] == expected_rows(&plan, &shards, &rows, 0));
                }
                println!(
                    "erasure {k}+{m}, shards of {:>3} KiB: encode {encode_us:8.1} us ({:5.2} GB/s of data), \
                     rebuild {m} lost shards {:8.1} us, rebuild one row {:8.1} us",
                    plan.shard_blocks() as usize * BLOCK_BYTES / 1024,
                    (plan.blocks() as usize * BLOCK_BYTES) as f64 / encode_us / 1e3,
                    rebuild_us[0],
                    rebuild_us[1],
                );
            }
        }
    }
}
