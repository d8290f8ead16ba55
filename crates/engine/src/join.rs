//! Runs a bounded set of futures concurrently on the current task, and yields to the others.
//! The engine has no runtime of its own, so it cannot spawn: the log engine joins the per-drive
//! writes, reads and syncs of one batch with this, and the test executor in `testing` joins its
//! writers with the same code.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A boxed future that need not be `Send`.
pub type LocalFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// The most futures one `join_all` takes: a bound, far above one per drive.
pub const JOIN_FUTURES_MAX: usize = 4096;

/// Resolves to every output, in the order of `futures`.
pub fn join_all<T>(futures: Vec<LocalFuture<'_, T>>) -> JoinAll<'_, T> {
    assert!(futures.len() <= JOIN_FUTURES_MAX, "join_all of {} futures", futures.len());
    let outputs = futures.iter().map(|_| None).collect();
    JoinAll { futures: futures.into_iter().map(Some).collect(), outputs }
}

pub struct JoinAll<'a, T> {
    futures: Vec<Option<LocalFuture<'a, T>>>,
    outputs: Vec<Option<T>>,
}

// Outputs are never pinned; the futures are boxed.
impl<T> Unpin for JoinAll<'_, T> {}

impl<T> Future for JoinAll<'_, T> {
    type Output = Vec<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Vec<T>> {
        let this = self.get_mut();
        let mut pending = false;
        for (slot, output) in this.futures.iter_mut().zip(this.outputs.iter_mut()) {
            if let Some(future) = slot {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => {
                        *output = Some(value);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            return Poll::Pending;
        }
        Poll::Ready(this.outputs.iter_mut().filter_map(Option::take).collect())
    }
}

/// Returns `Pending` once after asking to be polled again: lets other tasks of the thread run
/// (for example while a checkpoint waits for other threads' batches).
pub fn yield_now() -> YieldNow {
    YieldNow { yielded: false }
}

#[derive(Debug)]
pub struct YieldNow {
    yielded: bool,
}

impl Future for YieldNow {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Completes as soon as either future does (the other is dropped unfinished).
pub async fn either<A: Future<Output = ()>, B: Future<Output = ()>>(a: A, b: B) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    std::future::poll_fn(|cx| {
        if a.as_mut().poll(cx).is_ready() || b.as_mut().poll(cx).is_ready() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await
}
