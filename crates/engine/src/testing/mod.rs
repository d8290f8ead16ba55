//! Test support shared by every backend of the engine's traits (feature `testing`): a tiny
//! single-threaded executor, a seeded PRNG, self-describing block contents, a simulated drive
//! with a durable image and injected faults, and the conformance check that `engine` runs over
//! simulated drives and `io` runs over io_uring.
//!
//! Nothing here is for production: it panics on any mismatch, which is what a test wants.

mod check;
mod sim;

pub use check::{
    check_log_engine, run_writer, verify_volume, CheckConfig, CheckReport, Oracle, WriterContext,
};
pub use sim::{SimDrive, SimEvent, SimStats};

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use crate::volumes::VolumeId;

pub use crate::join::{join_all, yield_now, JoinAll, LocalFuture as LocalBoxFuture, YieldNow};

/// The most polls `block_on` makes before declaring the future stuck.
pub const BLOCK_ON_POLLS_MAX: u64 = 100_000_000;

/// Why [`run_polls`] stopped before the future finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// The poll budget ran out.
    PollsExhausted,
    /// The future returned `Pending` without arranging to be woken: it would hang forever.
    Stalled,
}

struct FlagWaker(AtomicBool);

impl Wake for FlagWaker {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Polls `future` on this thread at most `polls_max` times, then drops it (the way a crash or a
/// cancelled request abandons work in flight).
pub fn run_polls<F: Future>(future: F, polls_max: u64) -> Result<F::Output, Stopped> {
    let flag = Arc::new(FlagWaker(AtomicBool::new(false)));
    let waker = Waker::from(Arc::clone(&flag));
    let mut context = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    for _ in 0..polls_max {
        flag.0.store(false, Ordering::Relaxed);
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return Ok(output);
        }
        if !flag.0.load(Ordering::Relaxed) {
            return Err(Stopped::Stalled);
        }
    }
    Err(Stopped::PollsExhausted)
}

/// Runs a future to completion on this thread; for futures that only wait on each other and on
/// simulated drives.
pub fn block_on<F: Future>(future: F) -> F::Output {
    match run_polls(future, BLOCK_ON_POLLS_MAX) {
        Ok(output) => output,
        Err(stopped) => panic!("block_on: the future did not finish: {stopped:?}"),
    }
}

/// SplitMix64: a tiny seeded PRNG, so every test run replays from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..bound` (bound > 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0);
        self.next_u64() % bound
    }

    /// True with probability `numerator / denominator`.
    pub fn chance(&mut self, numerator: u64, denominator: u64) -> bool {
        self.below(denominator) < numerator
    }
}

const BLOCK_BYTES: usize = types::BLOCK_SIZE_BYTES as usize;

/// Random bytes after the 24-byte header of [`fill_block`], by `tag % 5`: the rest of the block
/// is a compressible pattern, so compressed volumes see raw blocks and every slot class.
const RANDOM_BYTES_BY_TAG: [usize; 5] = [BLOCK_BYTES - 24, 1600, 700, 260, 0];

/// Fills one block with content that names itself: volume, block number and write tag in the
/// first 24 bytes, then bytes derived from them: pseudo-random for a length that depends on the
/// tag, then a repeating pattern (compressible to different degrees). Tag 0 means zeros (never
/// written or zeroed).
pub fn fill_block(block: &mut [u8], volume: VolumeId, block_number: u64, tag: u64) {
    assert_eq!(block.len(), BLOCK_BYTES);
    if tag == 0 {
        block.fill(0);
        return;
    }
    block[0..8].copy_from_slice(&volume.0.to_le_bytes());
    block[8..16].copy_from_slice(&block_number.to_le_bytes());
    block[16..24].copy_from_slice(&tag.to_le_bytes());
    let mut rng = Rng::new(volume.0 ^ block_number.rotate_left(20) ^ tag.rotate_left(40));
    let random_end = 24 + RANDOM_BYTES_BY_TAG[(tag % 5) as usize];
    for word in block[24..random_end].chunks_mut(8) {
        let bytes = rng.next_u64().to_le_bytes();
        word.copy_from_slice(&bytes[..word.len()]);
    }
    let pattern = rng.next_u64().to_le_bytes();
    for (offset, byte) in block[random_end..].iter_mut().enumerate() {
        *byte = pattern[(offset / 64) % 8];
    }
}

/// Whether a block holds exactly what [`fill_block`] writes for these arguments.
pub fn block_matches(block: &[u8], volume: VolumeId, block_number: u64, tag: u64) -> bool {
    let mut expected = [0u8; BLOCK_BYTES];
    fill_block(&mut expected, volume, block_number, tag);
    block == expected
}

/// Says what a block holds, for failure messages.
pub fn describe_block(block: &[u8]) -> String {
    if block.iter().all(|b| *b == 0) {
        return "zeros".to_owned();
    }
    let field = |range: std::ops::Range<usize>| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&block[range]);
        u64::from_le_bytes(bytes)
    };
    let (volume, block_number, tag) = (VolumeId(field(0..8)), field(8..16), field(16..24));
    if block_matches(block, volume, block_number, tag) {
        format!("tag {tag} written to block {block_number} of {volume}")
    } else {
        format!("torn or foreign bytes (header says tag {tag}, block {block_number}, {volume})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_describe_themselves() {
        let mut block = [0u8; BLOCK_BYTES];
        fill_block(&mut block, VolumeId(3), 17, 99);
        assert!(block_matches(&block, VolumeId(3), 17, 99));
        assert!(!block_matches(&block, VolumeId(3), 18, 99));
        assert!(!block_matches(&block, VolumeId(3), 17, 0));
        assert_eq!(describe_block(&block), "tag 99 written to block 17 of volume 3");
        block[2000] ^= 1;
        assert!(describe_block(&block).starts_with("torn"));
        fill_block(&mut block, VolumeId(3), 17, 0);
        assert_eq!(describe_block(&block), "zeros");
    }

    #[test]
    fn executor_detects_stalls_and_budgets() {
        assert_eq!(run_polls(std::future::pending::<()>(), 10), Err(Stopped::Stalled));
        let forever = async {
            loop {
                yield_now().await;
            }
        };
        assert_eq!(run_polls(forever, 10), Err(Stopped::PollsExhausted));
        let outputs = block_on(join_all(vec![
            Box::pin(async {
                yield_now().await;
                1
            }),
            Box::pin(async { 2 }),
        ]));
        assert_eq!(outputs, [1, 2]);
    }
}
