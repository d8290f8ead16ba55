//! Single-threaded wake-ups for data-path threads: a tiny `Notify` without locks or atomics.
//!
//! The engine runs on one thread per core and may not depend on a runtime, so it cannot use
//! tokio's primitives; a thread-safe one would add atomics and a lock to every I/O. A waiter
//! keeps its slot for its whole life, so waiting again after a spurious wake-up allocates
//! nothing: after warm-up the slot table stops growing (it is as long as the most waiters ever
//! present at once, which the callers bound).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

enum Slot {
    Vacant { next_free: Option<usize> },
    Occupied(Option<Waker>),
}

/// Wakes every task waiting on it. A waiter is released by any `notify_all` after it was
/// created, so the usual pattern has no lost wake-up: check the condition, and if it does not
/// hold, create the [`Notified`] and await it before yielding anywhere else.
pub struct LocalNotify {
    generation: Cell<u64>,
    slots: RefCell<Vec<Slot>>,
    free_head: Cell<Option<usize>>,
}

impl Default for LocalNotify {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalNotify {
    pub fn new() -> Self {
        Self {
            generation: Cell::new(0),
            slots: RefCell::new(Vec::new()),
            free_head: Cell::new(None),
        }
    }

    /// A future that completes at the next `notify_all`.
    pub fn notified(&self) -> Notified<'_> {
        Notified { notify: self, generation: self.generation.get(), slot: None }
    }

    /// Releases every waiter created before this call.
    pub fn notify_all(&self) {
        self.generation.set(self.generation.get() + 1);
        let slot_count = self.slots.borrow().len();
        for index in 0..slot_count {
            // Take each waker out before waking it, so a wake that runs code touching this
            // notifier finds it unborrowed.
            let waker = match &mut self.slots.borrow_mut()[index] {
                Slot::Occupied(waker) => waker.take(),
                Slot::Vacant { .. } => None,
            };
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }

    /// How many waiters are registered; for tests and assertions.
    pub fn waiter_count(&self) -> usize {
        self.slots.borrow().iter().filter(|slot| matches!(slot, Slot::Occupied(_))).count()
    }

    fn register(&self, slot: &mut Option<usize>, waker: &Waker) {
        let mut slots = self.slots.borrow_mut();
        match *slot {
            Some(index) => match &mut slots[index] {
                Slot::Occupied(Some(current)) if current.will_wake(waker) => {}
                Slot::Occupied(current) => *current = Some(waker.clone()),
                Slot::Vacant { .. } => unreachable!("a waiter's slot is occupied until it drops"),
            },
            None => {
                let index = match self.free_head.get() {
                    Some(index) => {
                        let Slot::Vacant { next_free } = slots[index] else {
                            unreachable!("the free list holds vacant slots only")
                        };
                        self.free_head.set(next_free);
                        slots[index] = Slot::Occupied(Some(waker.clone()));
                        index
                    }
                    None => {
                        slots.push(Slot::Occupied(Some(waker.clone())));
                        slots.len() - 1
                    }
                };
                *slot = Some(index);
            }
        }
    }

    fn unregister(&self, index: usize) {
        let waker = {
            let mut slots = self.slots.borrow_mut();
            let old = std::mem::replace(
                &mut slots[index],
                Slot::Vacant { next_free: self.free_head.get() },
            );
            self.free_head.set(Some(index));
            old
        };
        // Dropped outside the borrow: dropping a waker may run arbitrary code.
        drop(waker);
    }
}

/// Completes once the [`LocalNotify`] it came from is notified after its creation.
pub struct Notified<'a> {
    notify: &'a LocalNotify,
    generation: u64,
    slot: Option<usize>,
}

impl Future for Notified<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.notify.generation.get() != this.generation {
            if let Some(index) = this.slot.take() {
                this.notify.unregister(index);
            }
            return Poll::Ready(());
        }
        this.notify.register(&mut this.slot, cx.waker());
        Poll::Pending
    }
}

impl Drop for Notified<'_> {
    fn drop(&mut self) {
        if let Some(index) = self.slot.take() {
            self.notify.unregister(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{block_on, join_all, yield_now};
    use std::rc::Rc;

    #[test]
    fn wakes_all_waiters_and_reuses_slots() {
        let notify = LocalNotify::new();
        let woken = Cell::new(0);
        for _round in 0..3 {
            let waiters: Vec<Pin<Box<dyn Future<Output = ()> + '_>>> = (0..5)
                .map(|_| {
                    let fut: Pin<Box<dyn Future<Output = ()>>> = Box::pin(async {
                        notify.notified().await;
                        woken.set(woken.get() + 1);
                    });
                    fut
                })
                .collect();
            let notifier = Box::pin(async {
                for _ in 0..3 {
                    yield_now().await;
                }
                assert_eq!(notify.waiter_count(), 5);
                notify.notify_all();
            });
            let mut all = waiters;
            all.push(notifier);
            block_on(join_all(all));
            assert_eq!(notify.waiter_count(), 0);
        }
        assert_eq!(woken.get(), 15);
        assert!(notify.slots.borrow().len() <= 5, "slots are reused, not grown");
    }

    #[test]
    fn notification_before_wait_is_not_lost_for_existing_waiters() {
        let notify = Rc::new(LocalNotify::new());
        let notified = notify.notified();
        notify.notify_all();
        block_on(notified);
        // A waiter created after the notification waits for the next one.
        let later = notify.notified();
        assert!(crate::testing::run_polls(later, 3).is_err());
    }

    #[test]
    fn dropped_waiter_frees_its_slot() {
        let notify = LocalNotify::new();
        let mut waiter = Box::pin(notify.notified());
        let waker = Waker::noop();
        assert!(waiter.as_mut().poll(&mut Context::from_waker(waker)).is_pending());
        assert_eq!(notify.waiter_count(), 1);
        drop(waiter);
        assert_eq!(notify.waiter_count(), 0);
        notify.notify_all();
    }
}
