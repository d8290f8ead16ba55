//! A block target in RAM that implements the bench's `Connector` and `BlockQueue` the way an
//! NVMe/TCP initiator would: requests complete after small random delays, out of order, and the
//! data moves at completion time. Faults can be switched on to prove the verifier catches them:
//! misdirected reads, torn writes, dropped (stale) writes, failed commands and a crash.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use bench::{BlockQueue, Connector, IoCompletion, IoKind, IoRequest, IoStatus, VERIFY_BLOCK_BYTES};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BLOCK: usize = VERIFY_BLOCK_BYTES;
/// The NVMe status a failed command reports here: Generic, Internal Error (0x06).
pub const INTERNAL_ERROR_STATUS: u16 = 0x0006;

/// What goes wrong, if anything. Block faults hit one LBA, every time after its first write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// Reads of `lba` return the block after it.
    MisdirectedRead {
        lba: u64,
    },
    /// Writes to `lba` after its first one store the first half of the block only.
    TornWrite {
        lba: u64,
    },
    /// Writes to `lba` after its first one are acknowledged but not stored.
    DroppedWrite {
        lba: u64,
    },
    /// Every `every`-th write fails with an error status; half of those still store their data.
    FailWrites {
        every: u64,
    },
    /// After `after` completions the target dies: every queue's in-flight writes are stored or
    /// not at random, block by block, and every queue fails from then on.
    Crash {
        after: u64,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum RamError {
    #[error("the RAM target crashed")]
    Crashed,
}

struct Shared {
    data: RefCell<Vec<u8>>,
    fault: Fault,
    fault_block_writes: Cell<u64>,
    writes: Cell<u64>,
    completions: Cell<u64>,
    crashed: Cell<bool>,
    reads: Cell<u64>,
}

/// The target: a connector that opens queues onto one shared RAM namespace.
#[derive(Clone)]
pub struct RamTarget {
    shared: Rc<Shared>,
    delay_us_max: u64,
    seed: u64,
}

impl RamTarget {
    pub fn new(size_bytes: usize, fault: Fault) -> RamTarget {
        assert!(size_bytes % BLOCK == 0);
        RamTarget::with_data(vec![0; size_bytes], fault)
    }

    fn with_data(data: Vec<u8>, fault: Fault) -> RamTarget {
        let shared = Shared {
            data: RefCell::new(data),
            fault,
            fault_block_writes: Cell::new(0),
            writes: Cell::new(0),
            completions: Cell::new(0),
            crashed: Cell::new(false),
            reads: Cell::new(0),
        };
        RamTarget { shared: Rc::new(shared), delay_us_max: 1500, seed: 1 }
    }

    /// Completion delays are uniform in `0..=delay_us_max` microseconds (timers round up to
    /// the millisecond); 0 completes every request at once.
    pub fn with_delay_us_max(mut self, delay_us_max: u64) -> RamTarget {
        self.delay_us_max = delay_us_max;
        self
    }

    /// The same data, as a freshly started target without faults (a restart after a crash).
    pub fn restart(&self) -> RamTarget {
        RamTarget::with_data(self.shared.data.borrow().clone(), Fault::None)
    }

    /// Direct access to the stored bytes, to damage them on purpose.
    pub fn with_data_mut<T>(&self, change: impl FnOnce(&mut [u8]) -> T) -> T {
        change(&mut self.shared.data.borrow_mut())
    }

    pub fn read_count(&self) -> u64 {
        self.shared.reads.get()
    }
}

impl Connector for RamTarget {
    type Queue = RamQueue;
    type Error = RamError;

    async fn connect(
        &mut self,
        queue_count: u16,
        queue_depth: u16,
    ) -> Result<Vec<RamQueue>, RamError> {
        self.seed += 1;
        Ok((0..queue_count)
            .map(|index| RamQueue {
                shared: self.shared.clone(),
                depth: queue_depth,
                pending: Vec::with_capacity(usize::from(queue_depth)),
                rng: SmallRng::seed_from_u64(self.seed * 1000 + u64::from(index)),
                delay_us_max: self.delay_us_max,
            })
            .collect())
    }
}

struct Pending {
    due: tokio::time::Instant,
    request: IoRequest,
}

pub struct RamQueue {
    shared: Rc<Shared>,
    depth: u16,
    pending: Vec<Pending>,
    rng: SmallRng,
    delay_us_max: u64,
}

impl RamQueue {
    /// The crash: store each in-flight write's blocks or not, at random, then forget them all.
    fn crash(&mut self) -> RamError {
        let mut data = self.shared.data.borrow_mut();
        for pending in self.pending.drain(..) {
            if pending.request.kind == IoKind::Write {
                let offset = pending.request.offset_bytes as usize;
                for (index, block) in pending.request.buffer.chunks_exact(BLOCK).enumerate() {
                    if self.rng.random_bool(0.5) {
                        let at = offset + index * BLOCK;
                        data[at..at + BLOCK].copy_from_slice(block);
                    }
                }
            }
        }
        RamError::Crashed
    }

    fn execute(&mut self, mut request: IoRequest) -> IoCompletion {
        let shared = &self.shared;
        let offset = request.offset_bytes as usize;
        let length = request.buffer.len();
        let first_lba = request.offset_bytes / BLOCK as u64;
        let blocks = (length / BLOCK) as u64;
        let hits = |lba: u64| (first_lba..first_lba + blocks).contains(&lba);
        let mut status = IoStatus::Success;
        let mut data = shared.data.borrow_mut();
        match request.kind {
            IoKind::Read => {
                shared.reads.set(shared.reads.get() + 1);
                request.buffer.copy_from_slice(&data[offset..offset + length]);
                if let Fault::MisdirectedRead { lba } = shared.fault {
                    if hits(lba) && ((lba + 2) as usize) * BLOCK <= data.len() {
                        let at = (lba - first_lba) as usize * BLOCK;
                        let source = (lba + 1) as usize * BLOCK;
                        request.buffer[at..at + BLOCK]
                            .copy_from_slice(&data[source..source + BLOCK]);
                    }
                }
            }
            IoKind::Write => {
                let writes = shared.writes.get() + 1;
                shared.writes.set(writes);
                let mut store = true;
                if let Fault::FailWrites { every } = shared.fault {
                    if writes % every == 0 {
                        status = IoStatus::Failed { status_code: INTERNAL_ERROR_STATUS };
                        store = self.rng.random_bool(0.5);
                    }
                }
                // The faulty block's bytes before this write, to put back what the fault loses.
                let faulty = match shared.fault {
                    Fault::TornWrite { lba } | Fault::DroppedWrite { lba } if hits(lba) => {
                        let at = lba as usize * BLOCK;
                        Some((at, data[at..at + BLOCK].to_vec()))
                    }
                    _ => None,
                };
                if store {
                    data[offset..offset + length].copy_from_slice(&request.buffer);
                }
                if let Some((at, old)) = faulty {
                    let seen = shared.fault_block_writes.get() + 1;
                    shared.fault_block_writes.set(seen);
                    if seen > 1 {
                        let lost_from = if matches!(shared.fault, Fault::TornWrite { .. }) {
                            BLOCK / 2
                        } else {
                            0
                        };
                        data[at + lost_from..at + BLOCK].copy_from_slice(&old[lost_from..]);
                    }
                }
            }
        }
        IoCompletion { tag: request.tag, buffer: request.buffer, status }
    }
}

impl BlockQueue for RamQueue {
    type Error = RamError;

    fn size_bytes(&self) -> u64 {
        self.shared.data.borrow().len() as u64
    }

    fn submit(&mut self, request: IoRequest) -> Result<(), RamError> {
        if self.shared.crashed.get() {
            return Err(self.crash());
        }
        assert!(request.tag < self.depth, "tag {} at depth {}", request.tag, self.depth);
        assert!(self.pending.iter().all(|p| p.request.tag != request.tag), "tag reused in flight");
        assert!(request.offset_bytes % BLOCK as u64 == 0 && request.buffer.len() % BLOCK == 0);
        assert!(
            !request.buffer.is_empty() && request.buffer.len() <= bench::IO_SIZE_BYTES_MAX as usize
        );
        assert!(request.offset_bytes + request.buffer.len() as u64 <= self.size_bytes());
        let delay = Duration::from_micros(self.rng.random_range(0..=self.delay_us_max));
        self.pending.push(Pending { due: tokio::time::Instant::now() + delay, request });
        Ok(())
    }

    async fn next_completion(&mut self) -> Result<IoCompletion, RamError> {
        assert!(!self.pending.is_empty(), "next_completion with nothing in flight");
        let (index, due) = self
            .pending
            .iter()
            .enumerate()
            .map(|(index, pending)| (index, pending.due))
            .min_by_key(|(_, due)| *due)
            .expect("not empty");
        if due > tokio::time::Instant::now() {
            tokio::time::sleep_until(due).await;
        }
        if self.shared.crashed.get() {
            return Err(self.crash());
        }
        let pending = self.pending.swap_remove(index);
        let completions = self.shared.completions.get() + 1;
        self.shared.completions.set(completions);
        if let Fault::Crash { after } = self.shared.fault {
            if completions > after {
                self.shared.crashed.set(true);
                self.pending.push(pending);
                return Err(self.crash());
            }
        }
        Ok(self.execute(pending.request))
    }
}
