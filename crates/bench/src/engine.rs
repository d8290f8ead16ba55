//! Hot path. Drives every queue of one phase (a workload, the fill, or the read-back check): keeps
//! each queue full to its depth, times each I/O, records latencies and checks data.
//!
//! Per I/O there is no allocation and no system call besides what the queue does itself: a slot
//! table per queue owns the buffers and hands them to the queue and back, tags are slot indices,
//! the clock is read once per completion (the same instant stamps the requests submitted right
//! after it), and latencies go into preallocated HDR histograms. All queues run in one task: a
//! small join polls them in turn, so shared state (counters, the verifier) is plain `Cell` and
//! `RefCell` with no locks.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Instant;

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::target::{AlignedBuf, BlockQueue, IoCompletion, IoKind, IoRequest, IoStatus};
use crate::verify::{Verifier, VERIFY_BLOCK_BYTES};
use crate::{BenchError, Workload};

/// Latencies above this are recorded as this (a minute: far beyond any sane I/O).
pub(crate) const LATENCY_NS_MAX: u64 = 60_000_000_000;
/// HDR histogram precision: three significant digits.
const LATENCY_SIGNIFICANT_DIGITS: u8 = 3;
/// How many neighbouring ranges a random pick tries when the first one is busy (`--verify` only).
const BUSY_PROBES_MAX: u64 = 64;

/// One queue's slots and random generator; lives for a whole run, across phases.
pub(crate) struct QueueState {
    slots: Vec<Slot>,
    /// Tags of free slots; a stack, so recently used (cache-warm) buffers go out first.
    free: Vec<u16>,
    in_flight: u32,
    rng: SmallRng,
}

struct Slot {
    /// `None` while the queue owns the buffer (the request is in flight).
    buffer: Option<AlignedBuf>,
    kind: IoKind,
    offset_bytes: u64,
    length_bytes: u32,
    submitted_at: Instant,
}

impl QueueState {
    /// `depth` slots with buffers of `buffer_bytes`, filled with random bytes once (what a write
    /// without `--verify` sends, apart from the block headers stamped per write).
    pub(crate) fn new(depth: u16, buffer_bytes: u32, seed: u64) -> QueueState {
        assert!(depth > 0);
        let mut rng = SmallRng::seed_from_u64(seed);
        let now = Instant::now();
        let slots = (0..depth)
            .map(|_| {
                let mut buffer = AlignedBuf::new(buffer_bytes as usize);
                rng.fill(&mut buffer[..]);
                Slot {
                    buffer: Some(buffer),
                    kind: IoKind::Read,
                    offset_bytes: 0,
                    length_bytes: 0,
                    submitted_at: now,
                }
            })
            .collect();
        QueueState { slots, free: (0..depth).rev().collect(), in_flight: 0, rng }
    }
}

/// Where a phase's I/Os go.
pub(crate) enum OpSource {
    /// A standard workload: random offsets aligned to the I/O size until `end`; latencies count
    /// for completions in `ramp_end .. end`.
    Random { workload: Workload, slot_count: u64, ramp_end: Instant, end: Instant },
    /// Sequential writes of `io_size_bytes` over the region, each queue taking the next chunk
    /// (the `--fill`).
    Fill { region_size_bytes: u64, io_size_bytes: u32 },
    /// Reads of every block the verify map has seen a write begin on, in runs of up to
    /// `io_size_bytes` (the read-back check).
    WrittenBlocks { io_size_bytes: u32 },
}

/// Counters the progress line reads while the phase runs.
#[derive(Default)]
pub(crate) struct PhaseCounters {
    pub(crate) completed_ops: Cell<u64>,
    pub(crate) completed_bytes: Cell<u64>,
    pub(crate) measured_ops: Cell<u64>,
    pub(crate) measured_bytes: Cell<u64>,
    pub(crate) errors: Cell<u64>,
    pub(crate) mismatches: Cell<u64>,
    /// Progress lines shown so far (lets a test see that the line is not starved).
    pub(crate) progress_lines: Cell<u64>,
}

/// What every queue of a phase shares.
pub(crate) struct PhaseShared<'v, 'm> {
    pub(crate) verifier: Option<&'v RefCell<Verifier<'m>>>,
    /// The next byte offset (fill) or block (check) to hand out.
    pub(crate) cursor: Cell<u64>,
    pub(crate) counters: PhaseCounters,
}

/// One queue's measurements in one phase.
pub(crate) struct QueueStats {
    pub(crate) read_latency_ns: Histogram<u64>,
    pub(crate) write_latency_ns: Histogram<u64>,
    pub(crate) read_bytes: u64,
    pub(crate) write_bytes: u64,
    pub(crate) errors: u64,
    pub(crate) first_error_status: Option<u16>,
}

impl QueueStats {
    pub(crate) fn new() -> QueueStats {
        QueueStats {
            read_latency_ns: latency_histogram(),
            write_latency_ns: latency_histogram(),
            read_bytes: 0,
            write_bytes: 0,
            errors: 0,
            first_error_status: None,
        }
    }
}

pub(crate) fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_NS_MAX, LATENCY_SIGNIFICANT_DIGITS)
        .expect("constant histogram bounds are valid")
}

enum Pick {
    Op {
        kind: IoKind,
        offset_bytes: u64,
        length_bytes: u32,
    },
    /// Every range tried is in use by another I/O; try again after a completion.
    Busy,
    /// The phase has nothing more to submit.
    Exhausted,
}

fn pick(source: &OpSource, shared: &PhaseShared<'_, '_>, rng: &mut SmallRng, now: Instant) -> Pick {
    let block_bytes = VERIFY_BLOCK_BYTES as u64;
    match source {
        OpSource::Random { workload, slot_count, end, .. } => {
            if now >= *end {
                return Pick::Exhausted;
            }
            let kind = if rng.random_range(0..100u8) < workload.read_percent {
                IoKind::Read
            } else {
                IoKind::Write
            };
            let length_bytes = workload.block_size_bytes;
            let start = rng.random_range(0..*slot_count);
            let Some(verifier) = shared.verifier else {
                return Pick::Op {
                    kind,
                    offset_bytes: start * u64::from(length_bytes),
                    length_bytes,
                };
            };
            let blocks = length_bytes / VERIFY_BLOCK_BYTES as u32;
            let mut verifier = verifier.borrow_mut();
            for probe in 0..BUSY_PROBES_MAX.min(*slot_count) {
                let offset_bytes = (start + probe) % slot_count * u64::from(length_bytes);
                if verifier.try_lock(offset_bytes / block_bytes, blocks) {
                    return Pick::Op { kind, offset_bytes, length_bytes };
                }
            }
            Pick::Busy
        }
        OpSource::Fill { region_size_bytes, io_size_bytes } => {
            let offset_bytes = shared.cursor.get();
            if offset_bytes >= *region_size_bytes {
                return Pick::Exhausted;
            }
            let length_bytes =
                (*region_size_bytes - offset_bytes).min(u64::from(*io_size_bytes)) as u32;
            shared.cursor.set(offset_bytes + u64::from(length_bytes));
            if let Some(verifier) = shared.verifier {
                let locked = verifier
                    .borrow_mut()
                    .try_lock(offset_bytes / block_bytes, length_bytes / VERIFY_BLOCK_BYTES as u32);
                assert!(locked, "sequential fill ranges never overlap");
            }
            Pick::Op { kind: IoKind::Write, offset_bytes, length_bytes }
        }
        OpSource::WrittenBlocks { io_size_bytes } => {
            let verifier = shared.verifier.expect("the read-back check has a verifier");
            let mut verifier = verifier.borrow_mut();
            let blocks_max = u64::from(io_size_bytes / VERIFY_BLOCK_BYTES as u32);
            let block_count = verifier.map().block_count();
            // Skip blocks never written; this scan is bounded by the map, over the whole pass.
            let mut first = shared.cursor.get();
            while first < block_count && verifier.map().expected(first).counter_high == 0 {
                first += 1;
            }
            if first >= block_count {
                shared.cursor.set(block_count);
                return Pick::Exhausted;
            }
            let mut end = first + 1;
            while end < block_count
                && end - first < blocks_max
                && verifier.map().expected(end).counter_high != 0
            {
                end += 1;
            }
            shared.cursor.set(end);
            let blocks = (end - first) as u32;
            let locked = verifier.try_lock(first, blocks);
            assert!(locked, "read-back ranges never overlap");
            Pick::Op {
                kind: IoKind::Read,
                offset_bytes: first * block_bytes,
                length_bytes: blocks * VERIFY_BLOCK_BYTES as u32,
            }
        }
    }
}

/// Runs every queue of a phase until the phase's source is exhausted and all I/Os completed.
pub(crate) async fn drive_all<Q: BlockQueue>(
    queues: &mut [Q],
    states: &mut [QueueState],
    stats: &mut [QueueStats],
    source: &OpSource,
    shared: &PhaseShared<'_, '_>,
) -> Result<(), BenchError> {
    assert!(queues.len() == states.len() && queues.len() == stats.len());
    let futures = queues
        .iter_mut()
        .zip(states.iter_mut())
        .zip(stats.iter_mut())
        .enumerate()
        .map(|(index, ((queue, state), stats))| {
            drive_queue(index as u16, queue, state, stats, source, shared)
        })
        .collect();
    try_join_all(futures).await
}

/// Polls every future until all finish or one fails. The queues of one run are few (at most
/// `QUEUE_COUNT_MAX`), so polling them all on each wake costs less than per-future wakers.
async fn try_join_all<F: Future<Output = Result<(), BenchError>>>(
    futures: Vec<F>,
) -> Result<(), BenchError> {
    let mut pending: Vec<Option<Pin<Box<F>>>> =
        futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    std::future::poll_fn(|context| {
        let mut all_done = true;
        for entry in pending.iter_mut() {
            let Some(future) = entry else { continue };
            match future.as_mut().poll(context) {
                Poll::Ready(Ok(())) => *entry = None,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => all_done = false,
            }
        }
        if all_done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await
}

async fn drive_queue<Q: BlockQueue>(
    queue_index: u16,
    queue: &mut Q,
    state: &mut QueueState,
    stats: &mut QueueStats,
    source: &OpSource,
    shared: &PhaseShared<'_, '_>,
) -> Result<(), BenchError> {
    let queue_error =
        |error: Q::Error| BenchError::QueueFailed { queue: queue_index, source: Box::new(error) };
    let (measured_from, measured_until) = match source {
        OpSource::Random { ramp_end, end, .. } => (Some(*ramp_end), Some(*end)),
        OpSource::Fill { .. } | OpSource::WrittenBlocks { .. } => (None, None),
    };
    let mut now = Instant::now();
    let mut exhausted = false;
    loop {
        while !exhausted {
            let Some(&tag) = state.free.last() else { break };
            let (kind, offset_bytes, length_bytes) = match pick(source, shared, &mut state.rng, now)
            {
                Pick::Op { kind, offset_bytes, length_bytes } => (kind, offset_bytes, length_bytes),
                Pick::Busy => break,
                Pick::Exhausted => {
                    exhausted = true;
                    break;
                }
            };
            state.free.pop();
            let slot = &mut state.slots[usize::from(tag)];
            let mut buffer = slot.buffer.take().expect("a free slot holds its buffer");
            buffer.set_len(length_bytes as usize);
            let first_lba = offset_bytes / VERIFY_BLOCK_BYTES as u64;
            if kind == IoKind::Write {
                match shared.verifier {
                    Some(verifier) => {
                        verifier.borrow_mut().prepare_write(&mut buffer, first_lba)?
                    }
                    None => crate::verify::stamp_unverified(&mut buffer, first_lba),
                }
            }
            slot.kind = kind;
            slot.offset_bytes = offset_bytes;
            slot.length_bytes = length_bytes;
            slot.submitted_at = now;
            queue.submit(IoRequest { tag, kind, offset_bytes, buffer }).map_err(queue_error)?;
            state.in_flight += 1;
        }
        if state.in_flight == 0 {
            if exhausted {
                return Ok(());
            }
            // Other queues hold every range this one tried: let them complete first.
            tokio::task::yield_now().await;
            now = Instant::now();
            continue;
        }
        let completion = queue.next_completion().await.map_err(queue_error)?;
        now = Instant::now();
        complete(
            queue_index,
            state,
            stats,
            shared,
            completion,
            now,
            measured_from,
            measured_until,
        )?;
        // Let other queues and the progress line run even if this queue never returns Pending.
        tokio::task::coop::consume_budget().await;
    }
}

#[allow(clippy::too_many_arguments)]
fn complete(
    queue_index: u16,
    state: &mut QueueState,
    stats: &mut QueueStats,
    shared: &PhaseShared<'_, '_>,
    completion: IoCompletion,
    now: Instant,
    measured_from: Option<Instant>,
    measured_until: Option<Instant>,
) -> Result<(), BenchError> {
    let tag = usize::from(completion.tag);
    let contract = |what: String| BenchError::QueueContract { queue: queue_index, problem: what };
    let Some(slot) = state.slots.get_mut(tag) else {
        return Err(contract(format!("completion with tag {tag}, beyond the queue depth")));
    };
    if slot.buffer.is_some() {
        return Err(contract(format!("completion with tag {tag}, which is not in flight")));
    }
    if completion.buffer.len() != slot.length_bytes as usize {
        return Err(contract(format!(
            "completion of tag {tag} returned a buffer of {} bytes for a {}-byte request",
            completion.buffer.len(),
            slot.length_bytes
        )));
    }
    state.in_flight -= 1;
    let succeeded = completion.status == IoStatus::Success;
    if let IoStatus::Failed { status_code } = completion.status {
        stats.errors += 1;
        stats.first_error_status.get_or_insert(status_code);
        shared.counters.errors.set(shared.counters.errors.get() + 1);
    }
    let length_bytes = u64::from(slot.length_bytes);
    if let Some(verifier) = shared.verifier {
        let mut verifier = verifier.borrow_mut();
        let first_lba = slot.offset_bytes / VERIFY_BLOCK_BYTES as u64;
        let blocks = slot.length_bytes / VERIFY_BLOCK_BYTES as u32;
        match slot.kind {
            IoKind::Read if succeeded => {
                let wrong = verifier.check_read(&completion.buffer, first_lba);
                shared.counters.mismatches.set(shared.counters.mismatches.get() + wrong);
            }
            IoKind::Read => {}
            IoKind::Write => verifier.finish_write(first_lba, blocks, succeeded),
        }
        verifier.unlock(first_lba, blocks);
    }
    let counters = &shared.counters;
    counters.completed_ops.set(counters.completed_ops.get() + 1);
    counters.completed_bytes.set(counters.completed_bytes.get() + length_bytes);
    let measured = measured_from.is_none_or(|from| now >= from)
        && measured_until.is_none_or(|until| now < until);
    if measured && succeeded {
        let latency_ns =
            u64::try_from(now.duration_since(slot.submitted_at).as_nanos()).unwrap_or(u64::MAX);
        let (histogram, bytes) = match slot.kind {
            IoKind::Read => (&mut stats.read_latency_ns, &mut stats.read_bytes),
            IoKind::Write => (&mut stats.write_latency_ns, &mut stats.write_bytes),
        };
        histogram.saturating_record(latency_ns.max(1));
        *bytes += length_bytes;
        counters.measured_ops.set(counters.measured_ops.get() + 1);
        counters.measured_bytes.set(counters.measured_bytes.get() + length_bytes);
    }
    slot.buffer = Some(completion.buffer);
    state.free.push(completion.tag);
    Ok(())
}
