//! Hot path. One io_uring per data-path thread, driven from that thread's tokio current_thread
//! runtime.
//!
//! Submission is immediate: an operation takes a slot, pushes its SQE and submits it with one
//! `io_uring_enter` at once (so the device starts on it while the thread goes on; the driver
//! task, [`Ring::run`], retries what the kernel refused for the moment). Completion: the ring
//! runs in cooperative task-running mode where the kernel has it (no IPI per completion while
//! the thread runs) and signals an eventfd registered with it (IORING_REGISTER_EVENTFD); the
//! driver waits on that eventfd through tokio's reactor ([`AsyncFd`]), reaps the CQEs and wakes
//! the operations' futures.
//!
//! Cancel safety: an operation's buffer and file live in its slot from submission until its
//! completion is reaped, not in its future. Dropping a future mid-flight only marks the slot
//! abandoned; the completion frees it later. So the kernel never writes into freed memory nor
//! into a file descriptor number reused by another file. Dropping the ring waits for what is
//! still in flight (and leaks it if that takes too long) for the same reason.
//!
//! Bounded: at most [`INFLIGHT_OPS_MAX`] operations hold slots (which is also the submission
//! queue's size, so a push never finds it full, and at most the completion queue's size, so it
//! never overflows); further operations wait in FIFO order and are handed a slot directly when
//! one is released.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;
use std::fs::File;
use std::future::{poll_fn, Future};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use io_uring::{opcode, squeue, types as uring_types, IoUring};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use types::AlignedBuf;

/// Submission queue entries of each ring.
pub const RING_ENTRIES: u32 = 256;
/// Operations that may hold a slot at once; more wait for one.
pub const INFLIGHT_OPS_MAX: usize = RING_ENTRIES as usize;
/// How many times dropping a ring waits for one completion before it gives up and leaks the
/// buffers still in flight.
const DROP_WAIT_ROUNDS_MAX: usize = 4 * INFLIGHT_OPS_MAX;
/// Reads that drain the eventfd: one resets it, the next sees it empty.
const EVENTFD_DRAIN_READS_MAX: usize = 4;

const _: () = assert!(INFLIGHT_OPS_MAX <= RING_ENTRIES as usize);

/// Why a ring could not be set up or driven.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error(
        "creating an io_uring of {RING_ENTRIES} entries failed: {0}; Ferrite needs Linux 5.6 or \
         later with io_uring allowed (sysctl kernel.io_uring_disabled = 0)"
    )]
    Setup(#[source] io::Error),
    #[error("creating or registering the io_uring completion eventfd failed: {0}")]
    EventFd(#[source] io::Error),
    #[error("a Ring must be created on a thread running a tokio runtime with I/O enabled")]
    NoRuntime,
    #[error("submitting to the io_uring failed: {0}")]
    Submit(#[source] io::Error),
    #[error("waiting for io_uring completions failed: {0}")]
    Wait(#[source] io::Error),
}

enum SlotState {
    /// In the free list, or granted to a waiting operation that has not submitted yet.
    Free,
    InFlight {
        waker: Option<Waker>,
    },
    Completed {
        result: i32,
    },
    /// Its future was dropped; the completion frees the slot.
    Abandoned,
}

impl fmt::Debug for SlotState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Free => "Free",
            Self::InFlight { .. } => "InFlight",
            Self::Completed { .. } => "Completed",
            Self::Abandoned => "Abandoned",
        })
    }
}

/// What the kernel may use while an operation is in flight.
struct Slot {
    state: SlotState,
    buf: Option<AlignedBuf>,
    file: Option<Rc<File>>,
}

/// An operation waiting for a slot. Allocated only when every slot is taken.
struct SlotWaiter {
    waker: RefCell<Option<Waker>>,
    granted: Cell<Option<u32>>,
    cancelled: Cell<bool>,
}

struct RingState {
    uring: IoUring,
    slots: Box<[Slot]>,
    free: Vec<u32>,
    waiters: VecDeque<Rc<SlotWaiter>>,
    /// SQEs pushed and not yet consumed by the kernel.
    unsubmitted: usize,
    /// The driver task, when it waits for work.
    driver: Option<Waker>,
}

impl RingState {
    /// Frees a slot, or hands it to the first live waiter; returns the waker to wake, which the
    /// caller wakes after releasing the state.
    fn release(&mut self, slot: u32) -> Option<Waker> {
        let entry = &mut self.slots[slot as usize];
        entry.state = SlotState::Free;
        entry.buf = None;
        entry.file = None;
        while let Some(waiter) = self.waiters.pop_front() {
            if waiter.cancelled.get() {
                continue;
            }
            waiter.granted.set(Some(slot));
            return waiter.waker.borrow_mut().take();
        }
        self.free.push(slot);
        None
    }
}

/// An io_uring owned by one thread. Create it inside that thread's tokio runtime, spawn
/// [`Ring::run`] on the thread (`tokio::task::spawn_local`), and share it with `Rc`.
pub struct Ring {
    state: RefCell<RingState>,
    eventfd: AsyncFd<OwnedFd>,
}

impl fmt::Debug for Ring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring").field("inflight", &self.inflight()).finish()
    }
}

impl Ring {
    pub fn new() -> Result<Rc<Ring>, RingError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(RingError::NoRuntime);
        }
        let uring = build_uring()?;
        assert!(uring.params().sq_entries() as usize >= INFLIGHT_OPS_MAX);
        assert!(uring.params().cq_entries() as usize >= INFLIGHT_OPS_MAX);
        // SAFETY: eventfd takes no pointers; the result is checked below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(RingError::EventFd(io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a new, valid descriptor that nothing else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(raw) };
        uring.submitter().register_eventfd(eventfd.as_raw_fd()).map_err(RingError::EventFd)?;
        // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open and unchanged for its
        // whole life.
        let eventfd = unsafe { AsyncFd::register_with_interest(eventfd, Interest::READABLE) }
            .map_err(|error| RingError::EventFd(error.into_parts().1))?;
        let slots = (0..INFLIGHT_OPS_MAX)
            .map(|_| Slot { state: SlotState::Free, buf: None, file: None })
            .collect();
        let state = RingState {
            uring,
            slots,
            free: (0..INFLIGHT_OPS_MAX as u32).rev().collect(),
            waiters: VecDeque::new(),
            unsubmitted: 0,
            driver: None,
        };
        Ok(Rc::new(Ring { state: RefCell::new(state), eventfd }))
    }

    /// Operations holding a slot: in flight, abandoned but not completed, or completed but not
    /// yet collected by their future.
    pub fn inflight(&self) -> usize {
        INFLIGHT_OPS_MAX - self.state.borrow().free.len()
    }

    /// The driver: submits batches and reaps completions until the ring fails. Spawn it once on
    /// the ring's thread; no operation completes while it does not run.
    pub async fn run(self: Rc<Self>) -> Result<Infallible, RingError> {
        loop {
            let progressed = self.submit()?;
            self.reap();
            if !progressed && self.state.borrow().unsubmitted > 0 {
                // The kernel refused for now (EAGAIN/EBUSY); let completions drain first.
                tokio::task::yield_now().await;
                continue;
            }
            poll_fn(|cx| self.poll_work(cx)).await?;
        }
    }

    /// Submits the pending SQEs; false if the kernel took none.
    fn submit(&self) -> Result<bool, RingError> {
        let mut state = self.state.borrow_mut();
        if state.unsubmitted == 0 {
            return Ok(true);
        }
        match state.uring.submit() {
            Ok(consumed) => {
                state.unsubmitted -= consumed.min(state.unsubmitted);
                Ok(consumed > 0)
            }
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) =>
            {
                Ok(false)
            }
            Err(error) => Err(RingError::Submit(error)),
        }
    }

    /// Moves every available completion into its slot and wakes its future.
    fn reap(&self) {
        loop {
            let waker = {
                let mut state = self.state.borrow_mut();
                let Some(entry) = state.uring.completion().next() else { break };
                let slot = entry.user_data() as u32;
                let completed = SlotState::Completed { result: entry.result() };
                match std::mem::replace(&mut state.slots[slot as usize].state, completed) {
                    SlotState::InFlight { waker } => waker,
                    SlotState::Abandoned => state.release(slot),
                    other => panic!("io_uring completion for slot {slot} in state {other:?}"),
                }
            };
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }

    /// Ready when there is something to submit or reap.
    fn poll_work(&self, cx: &mut Context<'_>) -> Poll<Result<(), RingError>> {
        {
            let mut state = self.state.borrow_mut();
            if state.unsubmitted > 0 || !state.uring.completion().is_empty() {
                return Poll::Ready(Ok(()));
            }
            match &state.driver {
                Some(current) if current.will_wake(cx.waker()) => {}
                _ => state.driver = Some(cx.waker().clone()),
            }
        }
        match self.eventfd.poll_read_ready(cx) {
            Poll::Ready(Ok(mut guard)) => {
                let fd = self.eventfd.get_ref().as_raw_fd();
                for _ in 0..EVENTFD_DRAIN_READS_MAX {
                    let mut counter = 0u64;
                    // SAFETY: reads 8 bytes into a live u64 from a descriptor we own.
                    let read =
                        unsafe { libc::read(fd, (&raw mut counter).cast::<libc::c_void>(), 8) };
                    if read < 0 {
                        break;
                    }
                }
                // Only clears if no new event arrived since the guard was taken (tokio tracks it).
                guard.clear_ready();
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(RingError::Wait(error))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Reads `buf.len()` bytes at `offset_bytes`; returns the bytes read.
    pub async fn read_at(
        &self,
        file: &Rc<File>,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (io::Result<usize>, AlignedBuf) {
        let (result, buf) = Op::new(self, OpKind::Read { offset_bytes }, file, Some(buf)).await;
        (result.map(|count| count as usize), buf.expect("a read gives its buffer back"))
    }

    /// Writes `buf.len()` bytes at `offset_bytes`; returns the bytes written.
    pub async fn write_at(
        &self,
        file: &Rc<File>,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (io::Result<usize>, AlignedBuf) {
        self.write(file, offset_bytes, buf, false).await
    }

    /// Writes `buf.len()` bytes at `offset_bytes` with RWF_DSYNC: the write completes once it
    /// is durable, as if an fdatasync covering it followed; returns the bytes written.
    pub async fn write_dsync_at(
        &self,
        file: &Rc<File>,
        offset_bytes: u64,
        buf: AlignedBuf,
    ) -> (io::Result<usize>, AlignedBuf) {
        self.write(file, offset_bytes, buf, true).await
    }

    async fn write(
        &self,
        file: &Rc<File>,
        offset_bytes: u64,
        buf: AlignedBuf,
        dsync: bool,
    ) -> (io::Result<usize>, AlignedBuf) {
        let kind = OpKind::Write { offset_bytes, dsync };
        let (result, buf) = Op::new(self, kind, file, Some(buf)).await;
        (result.map(|count| count as usize), buf.expect("a write gives its buffer back"))
    }

    /// fdatasync(2).
    pub async fn fdatasync(&self, file: &Rc<File>) -> io::Result<()> {
        Op::new(self, OpKind::DataSync, file, None).await.0.map(drop)
    }

    /// fallocate(2) with `mode` (for example `FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`).
    pub async fn fallocate(
        &self,
        file: &Rc<File>,
        offset_bytes: u64,
        length_bytes: u64,
        mode: i32,
    ) -> io::Result<()> {
        let kind = OpKind::Fallocate { offset_bytes, length_bytes, mode };
        Op::new(self, kind, file, None).await.0.map(drop)
    }
}

/// The ring in cooperative task-running mode where the kernel has it (COOP_TASKRUN, Linux
/// 5.19; SINGLE_ISSUER, 6.0): a completion does not interrupt this thread with an IPI while it
/// runs, its CQE is posted at the thread's next system call or sleep (measured: 4 KiB random
/// reads +4%). Older kernels get the plain ring. (DEFER_TASKRUN, which would batch further, is
/// not used: in one bench run of several a thread spun without progress, not investigated.)
fn build_uring() -> Result<IoUring, RingError> {
    let cooperative =
        IoUring::builder().setup_single_issuer().setup_coop_taskrun().build(RING_ENTRIES);
    match cooperative {
        Ok(uring) => Ok(uring),
        Err(_) => IoUring::builder().build(RING_ENTRIES).map_err(RingError::Setup),
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        let state = self.state.get_mut();
        let busy = |state: &RingState| {
            state
                .slots
                .iter()
                .filter(|slot| {
                    matches!(slot.state, SlotState::InFlight { .. } | SlotState::Abandoned)
                })
                .count()
        };
        for _ in 0..DROP_WAIT_ROUNDS_MAX {
            if busy(state) == 0 {
                return;
            }
            match state.uring.submit_and_wait(1) {
                Ok(_) => {}
                Err(error)
                    if matches!(
                        error.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) => {}
                Err(_) => break,
            }
            let finished: Vec<u32> =
                state.uring.completion().map(|entry| entry.user_data() as u32).collect();
            for slot in finished {
                let entry = &mut state.slots[slot as usize];
                entry.state = SlotState::Free;
                entry.buf = None;
                entry.file = None;
            }
        }
        // The kernel may still use these buffers and descriptors: leak them rather than free
        // memory it could write into.
        for slot in state.slots.iter_mut() {
            if matches!(slot.state, SlotState::InFlight { .. } | SlotState::Abandoned) {
                std::mem::forget(slot.buf.take());
                std::mem::forget(slot.file.take());
            }
        }
    }
}

#[derive(Clone, Copy)]
enum OpKind {
    Read {
        offset_bytes: u64,
    },
    /// `dsync`: RWF_DSYNC, durable on completion.
    Write {
        offset_bytes: u64,
        dsync: bool,
    },
    DataSync,
    Fallocate {
        offset_bytes: u64,
        length_bytes: u64,
        mode: i32,
    },
}

enum Phase {
    Start,
    WaitingForSlot(Rc<SlotWaiter>),
    InFlight(u32),
    Finished,
}

/// One operation's future. Holds its buffer and file until submission, then only a slot index.
struct Op<'r> {
    ring: &'r Ring,
    kind: OpKind,
    file: Option<Rc<File>>,
    buf: Option<AlignedBuf>,
    phase: Phase,
}

impl<'r> Op<'r> {
    fn new(ring: &'r Ring, kind: OpKind, file: &Rc<File>, buf: Option<AlignedBuf>) -> Self {
        Op { ring, kind, file: Some(Rc::clone(file)), buf, phase: Phase::Start }
    }

    /// Moves the buffer and file into `slot` and pushes the SQE.
    fn submit(&mut self, slot: u32, waker: &Waker) {
        let driver = {
            let mut state = self.ring.state.borrow_mut();
            let entry = &mut state.slots[slot as usize];
            assert!(matches!(entry.state, SlotState::Free), "submitting into a busy slot");
            entry.file = self.file.take();
            entry.buf = self.buf.take();
            let fd = uring_types::Fd(entry.file.as_ref().expect("an op has a file").as_raw_fd());
            let sqe: squeue::Entry = match self.kind {
                OpKind::Read { offset_bytes } => {
                    let buf = entry.buf.as_mut().expect("a read has a buffer");
                    let length = u32::try_from(buf.len()).expect("I/O under 4 GiB");
                    opcode::Read::new(fd, buf.as_mut_ptr(), length).offset(offset_bytes).build()
                }
                OpKind::Write { offset_bytes, dsync } => {
                    let buf = entry.buf.as_ref().expect("a write has a buffer");
                    let length = u32::try_from(buf.len()).expect("I/O under 4 GiB");
                    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
                    opcode::Write::new(fd, buf.as_ptr(), length)
                        .offset(offset_bytes)
                        .rw_flags(flags)
                        .build()
                }
                OpKind::DataSync => {
                    opcode::Fsync::new(fd).flags(uring_types::FsyncFlags::DATASYNC).build()
                }
                OpKind::Fallocate { offset_bytes, length_bytes, mode } => {
                    opcode::Fallocate::new(fd, length_bytes).offset(offset_bytes).mode(mode).build()
                }
            };
            entry.state = SlotState::InFlight { waker: Some(waker.clone()) };
            let sqe = sqe.user_data(u64::from(slot));
            // SAFETY: the buffer and the file the entry points to are owned by the slot until
            // the completion is reaped (or forever, if the ring is dropped first), so they
            // outlive the kernel's use of them.
            let pushed = unsafe { state.uring.submission().push(&sqe) };
            pushed.expect("the submission queue has room for every slot");
            state.unsubmitted += 1;
            // Submitted at once, not at the driver's next turn: the device starts on it while
            // the thread goes on (measured: 4 KiB random reads +2%).
            if let Ok(consumed) = state.uring.submit() {
                state.unsubmitted -= consumed.min(state.unsubmitted);
            }
            // The driver only needs a turn for what the kernel did not take (or refused).
            if state.unsubmitted > 0 {
                state.driver.take()
            } else {
                None
            }
        };
        if let Some(driver) = driver {
            driver.wake();
        }
    }
}

impl Future for Op<'_> {
    type Output = (io::Result<u32>, Option<AlignedBuf>);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match &this.phase {
                Phase::Start => {
                    let slot = this.ring.state.borrow_mut().free.pop();
                    match slot {
                        Some(slot) => {
                            this.submit(slot, cx.waker());
                            this.phase = Phase::InFlight(slot);
                        }
                        None => {
                            let waiter = Rc::new(SlotWaiter {
                                waker: RefCell::new(Some(cx.waker().clone())),
                                granted: Cell::new(None),
                                cancelled: Cell::new(false),
                            });
                            this.ring.state.borrow_mut().waiters.push_back(Rc::clone(&waiter));
                            this.phase = Phase::WaitingForSlot(waiter);
                            return Poll::Pending;
                        }
                    }
                }
                Phase::WaitingForSlot(waiter) => match waiter.granted.take() {
                    Some(slot) => {
                        this.submit(slot, cx.waker());
                        this.phase = Phase::InFlight(slot);
                    }
                    None => {
                        let mut current = waiter.waker.borrow_mut();
                        if !current.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                            *current = Some(cx.waker().clone());
                        }
                        return Poll::Pending;
                    }
                },
                Phase::InFlight(slot) => {
                    let slot = *slot;
                    let (output, next) = {
                        let mut state = this.ring.state.borrow_mut();
                        let completed = match &mut state.slots[slot as usize].state {
                            SlotState::Completed { result } => Some(*result),
                            SlotState::InFlight { waker } => {
                                if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                                    *waker = Some(cx.waker().clone());
                                }
                                None
                            }
                            other => panic!("polling an op whose slot {slot} is {other:?}"),
                        };
                        match completed {
                            Some(result) => {
                                let buf = state.slots[slot as usize].buf.take();
                                let next = state.release(slot);
                                let output = if result < 0 {
                                    Err(io::Error::from_raw_os_error(-result))
                                } else {
                                    Ok(result as u32)
                                };
                                (Some((output, buf)), next)
                            }
                            None => (None, None),
                        }
                    };
                    if let Some(next) = next {
                        next.wake();
                    }
                    return match output {
                        Some(output) => {
                            this.phase = Phase::Finished;
                            Poll::Ready(output)
                        }
                        None => Poll::Pending,
                    };
                }
                Phase::Finished => panic!("an io_uring op was polled after it completed"),
            }
        }
    }
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        let next = match std::mem::replace(&mut self.phase, Phase::Finished) {
            Phase::Start | Phase::Finished => None,
            Phase::WaitingForSlot(waiter) => match waiter.granted.take() {
                // Granted but never used: pass it on.
                Some(slot) => self.ring.state.borrow_mut().release(slot),
                None => {
                    waiter.cancelled.set(true);
                    None
                }
            },
            Phase::InFlight(slot) => {
                let mut state = self.ring.state.borrow_mut();
                let entry = &mut state.slots[slot as usize];
                match entry.state {
                    SlotState::Completed { .. } => state.release(slot),
                    SlotState::InFlight { .. } => {
                        // The kernel still owns the buffer: the completion will free the slot.
                        entry.state = SlotState::Abandoned;
                        None
                    }
                    ref other => panic!("dropping an op whose slot {slot} is {other:?}"),
                }
            }
        };
        if let Some(next) = next {
            next.wake();
        }
    }
}
