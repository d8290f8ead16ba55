//! The admin queue's driver: one task owns a controller's admin [`QueuePair`] and runs the
//! commands of every caller on it (bring-up, keep-alive, Identify, log pages, features, the
//! shutdown), several at once, so that an Asynchronous Event Request can stay outstanding for as
//! long as the controller lives without holding up any other command.
//!
//! Callers send requests over a bounded channel and await a one-shot reply; the driver selects
//! between new requests and the socket. Ordinary commands are bounded by the command timeout (no
//! completion within it breaks the queue); an Asynchronous Event Request waits for an event, so
//! it has no timeout. The driver ends when the last [`AdminQueue`] handle is dropped, when the
//! connection breaks, or when the controller aborts it; every request still waiting then fails
//! with [`InitiatorError::QueueBroken`] naming why, and outstanding Asynchronous Event Requests
//! end with it instead of hanging.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nvmf::command::Sqe;
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::error::InitiatorError;
use crate::queue::{Completion, QueuePair, Submission};

/// What a caller waits on: the completion of its command, whatever its status, or the error
/// that broke the queue.
pub(crate) type AdminReply = oneshot::Receiver<Result<Completion, InitiatorError>>;

/// The shortest wait for the controller: a deadline that has just passed still gets this long.
const DEADLINE_RESOLUTION: Duration = Duration::from_millis(1);
/// Why the driver stopped when its last handle was dropped.
const CLOSED_REASON: &str = "the controller was closed";

/// One command for the driver.
struct AdminRequest {
    sqe: Sqe,
    submission: Submission,
    command: &'static str,
    /// An Asynchronous Event Request waits for an event, not for the controller: no timeout.
    awaits_event: bool,
    reply: oneshot::Sender<Result<Completion, InitiatorError>>,
}

/// A command the driver has submitted and not yet answered.
struct Waiter {
    command: &'static str,
    awaits_event: bool,
    reply: oneshot::Sender<Result<Completion, InitiatorError>>,
}

/// What the driver and the handles share: the address for errors and why the driver stopped.
#[derive(Debug)]
struct AdminStatus {
    address: SocketAddr,
    stopped: Mutex<Option<String>>,
}

impl AdminStatus {
    fn stopped(&self) -> Option<String> {
        // A poisoned lock only means a panic elsewhere; the reason string is still whole.
        self.stopped.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn stop(&self, reason: String) {
        let mut stopped = self.stopped.lock().unwrap_or_else(PoisonError::into_inner);
        stopped.get_or_insert(reason);
    }

    fn broken(&self) -> InitiatorError {
        broken(self, self.stopped().unwrap_or_else(|| CLOSED_REASON.to_owned()))
    }

    async fn wait(&self, receiver: AdminReply) -> Result<Completion, InitiatorError> {
        receiver.await.unwrap_or_else(|_| Err(self.broken()))
    }
}

/// A handle on the admin queue's driver; cloning it is cheap. The driver runs while a handle
/// lives (a [`WeakAdminQueue`] does not keep it).
#[derive(Debug, Clone)]
pub(crate) struct AdminQueue {
    requests: mpsc::Sender<AdminRequest>,
    status: Arc<AdminStatus>,
}

/// A handle that does not keep the driver running: for the tasks the controller owns (the
/// asynchronous event task), which must not keep a dropped controller's connection open.
#[derive(Debug, Clone)]
pub(crate) struct WeakAdminQueue {
    requests: mpsc::WeakSender<AdminRequest>,
    status: Arc<AdminStatus>,
}

impl WeakAdminQueue {
    pub fn upgrade(&self) -> Option<AdminQueue> {
        let requests = self.requests.upgrade()?;
        Some(AdminQueue { requests, status: Arc::clone(&self.status) })
    }

    /// The completion behind `receiver`, without keeping the driver running meanwhile.
    pub async fn wait(&self, receiver: AdminReply) -> Result<Completion, InitiatorError> {
        self.status.wait(receiver).await
    }

    /// The error of a driver that has stopped.
    pub fn broken(&self) -> InitiatorError {
        self.status.broken()
    }
}

impl AdminQueue {
    /// Starts the driver of `queue`, an admin queue already through its Fabrics Connect.
    /// Returns the handle and the driver task, which ends by itself once every handle is gone.
    pub fn start(queue: QueuePair) -> (AdminQueue, AbortHandle) {
        let depth = usize::from(queue.params().depth);
        let status =
            Arc::new(AdminStatus { address: queue.params().address, stopped: Mutex::new(None) });
        let (requests, receiver) = mpsc::channel(depth);
        let task = tokio::spawn(drive(queue, receiver, Arc::clone(&status)));
        (AdminQueue { requests, status }, task.abort_handle())
    }

    pub fn downgrade(&self) -> WeakAdminQueue {
        WeakAdminQueue { requests: self.requests.downgrade(), status: Arc::clone(&self.status) }
    }

    pub fn address(&self) -> SocketAddr {
        self.status.address
    }

    /// Why the driver stopped; `None` while it runs.
    pub fn stopped(&self) -> Option<String> {
        self.status.stopped()
    }

    /// Hands a command to the driver and returns what to await for its completion. Waits only
    /// while the driver's request channel is full.
    pub async fn send(
        &self,
        sqe: Sqe,
        submission: Submission,
        command: &'static str,
        awaits_event: bool,
    ) -> Result<AdminReply, InitiatorError> {
        let (reply, receiver) = oneshot::channel();
        let request = AdminRequest { sqe, submission, command, awaits_event, reply };
        if self.requests.send(request).await.is_err() {
            return Err(self.broken());
        }
        Ok(receiver)
    }

    /// Runs one command and returns its completion, whatever its status.
    pub async fn request(
        &self,
        sqe: Sqe,
        submission: Submission,
        command: &'static str,
    ) -> Result<Completion, InitiatorError> {
        let receiver = self.send(sqe, submission, command, false).await?;
        self.wait(receiver).await
    }

    /// Runs one command and turns a failed status into [`InitiatorError::CommandFailed`].
    pub async fn execute(
        &self,
        sqe: Sqe,
        submission: Submission,
        command: &'static str,
    ) -> Result<Completion, InitiatorError> {
        let completion = self.request(sqe, submission, command).await?;
        if completion.status.is_success() {
            Ok(completion)
        } else {
            Err(InitiatorError::CommandFailed {
                address: self.status.address,
                command,
                status: completion.status,
            })
        }
    }

    /// The completion behind `receiver`; the driver's end is an error naming why it ended.
    pub async fn wait(&self, receiver: AdminReply) -> Result<Completion, InitiatorError> {
        self.status.wait(receiver).await
    }

    fn broken(&self) -> InitiatorError {
        self.status.broken()
    }
}

fn broken(status: &AdminStatus, reason: String) -> InitiatorError {
    InitiatorError::QueueBroken { address: status.address, qid: 0, reason }
}

/// One turn of the driver: a new request (or the end of all handles), or progress on the
/// socket.
enum Step {
    Request(Option<AdminRequest>),
    Progress(Result<(), InitiatorError>),
}

/// The driver loop. See the module documentation.
async fn drive(
    mut queue: QueuePair,
    mut requests: mpsc::Receiver<AdminRequest>,
    status: Arc<AdminStatus>,
) {
    let depth = usize::from(queue.params().depth);
    let command_timeout = queue.params().command_timeout;
    let mut waiters: Vec<Option<Waiter>> = (0..depth).map(|_| None).collect();
    // While an ordinary command is outstanding: the time by which the controller must complete
    // something, pushed back by every completion.
    let mut deadline: Option<Instant> = None;
    let (reason, error) = loop {
        let timed = waiters.iter().flatten().find(|waiter| !waiter.awaits_event);
        let operation = timed.map_or("an Asynchronous Event Request", |waiter| waiter.command);
        let timeout = match timed {
            None => {
                deadline = None;
                None
            }
            Some(_) => {
                let now = Instant::now();
                let at = *deadline.get_or_insert(now + command_timeout);
                Some(at.saturating_duration_since(now).max(DEADLINE_RESOLUTION))
            }
        };
        let can_submit = queue.free_tag().is_some();
        let busy = queue.outstanding() > 0;
        assert!(can_submit || busy, "a queue with no free tag has commands outstanding");
        let step = tokio::select! {
            biased;
            result = queue.progress(operation, timeout, command_timeout), if busy => Step::Progress(result),
            request = requests.recv(), if can_submit => Step::Request(request),
        };
        match step {
            Step::Request(None) => break (CLOSED_REASON.to_owned(), None),
            Step::Request(Some(request)) => {
                let tag = queue.free_tag().expect("a free tag was checked before the select");
                match queue.submit(tag, request.sqe, request.submission) {
                    Ok(()) => {
                        waiters[usize::from(tag)] = Some(Waiter {
                            command: request.command,
                            awaits_event: request.awaits_event,
                            reply: request.reply,
                        });
                    }
                    Err(error) => {
                        // A request the queue refuses (say, too much data) fails alone.
                        let _ = request.reply.send(Err(error));
                        if let Some(reason) = queue.broken_reason() {
                            break (reason.to_owned(), None);
                        }
                    }
                }
            }
            Step::Progress(Err(error)) => break (error.to_string(), Some(error)),
            Step::Progress(Ok(())) => {
                while let Some(completion) = queue.take_completion() {
                    deadline = None;
                    if let Some(waiter) = waiters[usize::from(completion.tag)].take() {
                        // The caller may have given up waiting; its completion is dropped.
                        let _ = waiter.reply.send(Ok(completion));
                    }
                }
            }
        }
    };
    status.stop(reason.clone());
    tracing::debug!(address = %status.address, %reason, "admin queue stopped");
    // The error itself goes to the ordinary command that waited for it; the others learn why.
    let mut error = error;
    for waiter in waiters.iter_mut().filter_map(Option::take) {
        let own = if waiter.awaits_event { None } else { error.take() };
        let _ = waiter.reply.send(Err(own.unwrap_or_else(|| broken(&status, reason.clone()))));
    }
    // Requests still in the channel are dropped with it: their callers see the reason above.
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use nvmf::command::{admin_opcode, Cqe, Status};
    use nvmf::pdu::{self, Decoded, Framing, ICResp, Pdu, Role};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::controller::ADMIN_TRANSFER_BYTES;
    use crate::queue::{QueueParams, ADMIN_QUEUE_DEPTH};

    /// The command timeout of [`scripted_admin_queue`].
    pub const SCRIPTED_COMMAND_TIMEOUT: Duration = Duration::from_millis(300);

    /// An admin queue (after ICReq, without a Fabrics Connect) to a controller that answers each
    /// command capsule with the status `answer` gives, or never when it gives `None`; also
    /// returns how many capsules it received.
    pub async fn scripted_admin_queue(
        answer: fn(&Sqe) -> Option<Status>,
    ) -> (QueuePair, Arc<AtomicU32>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let received = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&received);
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let framing = Framing::new(Role::Controller, 1 << 20);
            let (mut input, mut chunk) = (Vec::new(), vec![0u8; 64 * 1024]);
            loop {
                let mut output = Vec::new();
                while let Ok(Decoded::Pdu { pdu, consumed_bytes }) = pdu::decode(&input, &framing) {
                    match pdu {
                        Pdu::ICReq(_) => pdu::encode_ic_resp(
                            &mut output,
                            &ICResp {
                                pfv: 0,
                                cpda: 0,
                                header_digest: false,
                                data_digest: false,
                                maxh2cdata: 4096,
                            },
                        ),
                        Pdu::CapsuleCmd(capsule) => {
                            counted.fetch_add(1, Ordering::SeqCst);
                            if let Some(status) = answer(&capsule.sqe) {
                                let cid = capsule.sqe.cid();
                                let cqe = Cqe { result: 0, sqhd: 0, sqid: 0, cid, status };
                                pdu::encode_capsule_resp(&mut output, &framing, &cqe);
                            }
                        }
                        other => panic!("unexpected {other:?}"),
                    }
                    input.drain(..consumed_bytes);
                }
                if stream.write_all(&output).await.is_err() {
                    return;
                }
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(read) => input.extend_from_slice(&chunk[..read]),
                }
            }
        });
        let queue = QueuePair::open(QueueParams {
            address,
            qid: 0,
            depth: ADMIN_QUEUE_DEPTH,
            in_capsule_bytes_max: 0,
            transfer_bytes_max: ADMIN_TRANSFER_BYTES,
            header_digest: false,
            data_digest: false,
            r2t_outstanding_max: 1,
            connect_timeout: Duration::from_secs(5),
            command_timeout: SCRIPTED_COMMAND_TIMEOUT,
        })
        .await
        .unwrap();
        (queue, received)
    }

    #[tokio::test]
    async fn an_event_request_waits_past_the_timeout_and_blocks_nothing() {
        // Event requests are never answered; Keep Alive is answered, Flush never is.
        let (queue, received) = scripted_admin_queue(|sqe| match sqe.opcode() {
            admin_opcode::ASYNC_EVENT_REQUEST => None,
            admin_opcode::KEEP_ALIVE => Some(Status::SUCCESS),
            _ => None,
        })
        .await;
        let (admin, driver) = AdminQueue::start(queue);
        let event =
            admin.send(Sqe::async_event_request(0), Submission::none(), "AER", true).await.unwrap();
        // Other commands run while it waits, well past the command timeout.
        for _ in 0..5 {
            let completion =
                admin.execute(Sqe::keep_alive(0), Submission::none(), "Keep Alive").await.unwrap();
            assert!(completion.status.is_success());
            tokio::time::sleep(SCRIPTED_COMMAND_TIMEOUT / 2).await;
        }
        assert_eq!(admin.stopped(), None, "an outstanding event request timed out");
        assert_eq!(received.load(Ordering::SeqCst), 6);

        // An ordinary command that gets no answer still times out, breaking the queue: it gets
        // the timeout, the event request learns why the queue stopped.
        let started = std::time::Instant::now();
        let error = admin.execute(Sqe::flush(0, 1), Submission::none(), "Flush").await.unwrap_err();
        assert!(matches!(error, InitiatorError::Timeout { operation: "Flush", .. }), "{error}");
        assert!(error.to_string().contains("within 300 ms"), "{error}");
        assert!(started.elapsed() < 10 * SCRIPTED_COMMAND_TIMEOUT);
        let ended = admin.wait(event).await.unwrap_err();
        assert!(matches!(ended, InitiatorError::QueueBroken { .. }), "{ended}");
        let error = admin.execute(Sqe::keep_alive(0), Submission::none(), "Keep Alive").await;
        assert!(matches!(error, Err(InitiatorError::QueueBroken { .. })), "{error:?}");
        driver.abort();
    }

    #[tokio::test]
    async fn dropping_the_last_handle_ends_the_driver_and_its_waiters() {
        let (queue, _) = scripted_admin_queue(|_| None).await;
        let (admin, driver) = AdminQueue::start(queue);
        let weak = admin.downgrade();
        let event =
            admin.send(Sqe::async_event_request(0), Submission::none(), "AER", true).await.unwrap();
        drop(admin);
        let ended = tokio::time::timeout(Duration::from_secs(5), weak.wait(event))
            .await
            .expect("the waiter ends with the driver");
        let error = ended.unwrap_err();
        assert!(error.to_string().contains(CLOSED_REASON), "{error}");
        assert!(weak.upgrade().is_none());
        let finished = async {
            while !driver.is_finished() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), finished).await.expect("the driver ends");
    }

    #[test]
    fn stopping_keeps_the_first_reason() {
        let status =
            AdminStatus { address: "127.0.0.1:4420".parse().unwrap(), stopped: Mutex::new(None) };
        assert_eq!(status.stopped(), None);
        status.stop("the connection broke".to_owned());
        status.stop(CLOSED_REASON.to_owned());
        assert_eq!(status.stopped().as_deref(), Some("the connection broke"));
        let error = broken(&status, "why".to_owned());
        assert!(
            error.to_string().contains("queue 0") && error.to_string().contains("why"),
            "{error}"
        );
    }
}
