//! Asynchronous events, handled as the Linux host does (`nvme_enable_aen`,
//! `nvme_complete_async_event`, `nvme_handle_aen_notice`, `nvme_ana_work`): after bring-up the
//! host enables the namespace attribute and ANA change notices the controller offers (OAES) with
//! Set Features Asynchronous Event Configuration, keeps [`ASYNC_EVENT_REQUESTS`] Asynchronous
//! Event Requests outstanding on the admin queue, and on each notice reads the log page that
//! clears it (RAE 0) and updates what the host knows, then submits the request again:
//!
//! - ANA change (notice 03h, log 0Ch): the ANA log page gives every group's state; the states are
//!   what [`crate::MultipathNamespace`] picks paths by, so a path changes state without any I/O
//!   failing on it.
//! - Namespace attribute changed (notice 00h, log 04h): the Changed Namespace List is read to
//!   clear the event and, as Linux does, not relied upon: the controller's namespace is
//!   identified again and its new size recorded.
//!
//! A request that completes with an error status (the controller aborted it, for example when
//! the connection is torn down) ends event reporting on it and is not submitted again, as Linux
//! does. Everything learnt is published in an [`AsyncEventState`] behind a `watch` channel, with
//! a generation that grows on every change.
//!
//! The completion dword 0 layout (event type bits 2:0, information bits 15:8, log page bits
//! 23:16) is decoded here: `nvmf` keeps its own copy private to the target.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nvmf::command::{feature, log_page, Sqe, NSID_ALL};
use nvmf::structures::{AnaLog, CHANGED_NAMESPACE_LOG_BYTES};
use nvmf::target::AnaState;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinSet};
use types::{AlignedBuf, Nqn};

use crate::admin::{AdminQueue, WeakAdminQueue};
use crate::controller::{identify_namespace, Namespace, ADMIN_TRANSFER_BYTES};
use crate::error::{status_name, InitiatorError};
use crate::queue::{Completion, Direction, Submission, ADMIN_QUEUE_DEPTH};

/// Asynchronous Event Requests kept outstanding per controller, at most (Linux keeps one); fewer
/// when Identify Controller AERL allows fewer.
pub const ASYNC_EVENT_REQUESTS: u16 = 1;
/// Asynchronous Event Configuration bits (Set Features 0Bh, CDW11) this host enables when OAES
/// offers them: namespace attribute notices (bit 8) and ANA change notices (bit 11).
pub const ASYNC_EVENT_NAMESPACE_ATTRIBUTE: u32 = 1 << 8;
pub const ASYNC_EVENT_ANA_CHANGE: u32 = 1 << 11;
const ASYNC_EVENTS_WANTED: u32 = ASYNC_EVENT_NAMESPACE_ATTRIBUTE | ASYNC_EVENT_ANA_CHANGE;

const _: () = assert!(ASYNC_EVENT_REQUESTS >= 1 && ASYNC_EVENT_REQUESTS < ADMIN_QUEUE_DEPTH);
const _: () = assert!(CHANGED_NAMESPACE_LOG_BYTES <= ADMIN_TRANSFER_BYTES);

/// Asynchronous event types (completion dword 0 bits 2:0).
pub mod event_type {
    pub const ERROR: u8 = 0;
    pub const SMART_HEALTH: u8 = 1;
    pub const NOTICE: u8 = 2;
    pub const IMMEDIATE: u8 = 3;
    pub const IO_COMMAND_SPECIFIC: u8 = 6;
    pub const VENDOR_SPECIFIC: u8 = 7;
}

/// Asynchronous event information of the notice type (completion dword 0 bits 15:8).
pub mod notice {
    pub const NAMESPACE_ATTRIBUTE_CHANGED: u8 = 0x00;
    pub const FIRMWARE_ACTIVATION_STARTING: u8 = 0x01;
    pub const TELEMETRY_LOG_CHANGED: u8 = 0x02;
    pub const ANA_CHANGE: u8 = 0x03;
    pub const DISCOVERY_LOG_CHANGED: u8 = 0xF0;
}

/// An Asynchronous Event Request's completion dword 0, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// One of [`event_type`].
    pub event_type: u8,
    /// The event within its type; for notices one of [`notice`].
    pub information: u8,
    /// The log page to read for details (and to clear the event).
    pub log_page: u8,
}

impl AsyncEvent {
    pub fn decode(dw0: u32) -> AsyncEvent {
        AsyncEvent {
            event_type: (dw0 & 0x7) as u8,
            information: (dw0 >> 8) as u8,
            log_page: (dw0 >> 16) as u8,
        }
    }

    fn is_notice(&self, information: u8) -> bool {
        self.event_type == event_type::NOTICE && self.information == information
    }
}

/// One ANA group as the last ANA log page read reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnaGroupState {
    pub grpid: u32,
    pub state: AnaState,
    /// The group's namespaces, in the order the log lists them.
    pub nsids: Vec<u32>,
}

/// What asynchronous events (and ANA log reads) have told the host about one controller.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AsyncEventState {
    /// Grows by one on every change of the fields below.
    pub generation: u64,
    /// Asynchronous Event Requests outstanding (handed to the admin queue, not yet completed).
    pub requests_outstanding: u16,
    /// Asynchronous event notices received, of any type.
    pub notices: u64,
    /// CHGCNT of the last ANA log page read; 0 before one or without ANA reporting.
    pub ana_change_count: u64,
    /// The groups of the last ANA log page read; empty without ANA reporting.
    pub ana_groups: Vec<AnaGroupState>,
    /// The controller's namespace as last identified; `None` once it is no longer usable.
    pub namespace: Option<Namespace>,
    /// Why event handling ended (the admin queue stopped, the controller aborted the request);
    /// `None` while it runs or if it never started.
    pub stopped: Option<String>,
}

/// Which controller the events are about, fixed at connect.
#[derive(Debug, Clone)]
pub(crate) struct EventContext {
    pub address: SocketAddr,
    pub subnqn: Nqn,
    /// The namespace identified again on attribute notices.
    pub nsid: Option<u32>,
    /// Identify Controller CMIC reports ANA: without it every namespace is optimized.
    pub ana_reporting: bool,
    /// Bytes of the ANA log page read (whole dwords, at most [`ADMIN_TRANSFER_BYTES`]).
    pub ana_log_bytes: usize,
}

/// A controller's event state, shared by the controller and its event task.
#[derive(Debug)]
pub(crate) struct Events {
    pub context: EventContext,
    state: watch::Sender<AsyncEventState>,
    /// Holds an ANA log read together with the update it makes, so that an older read (the event
    /// task's, or one after a path error) never overwrites a newer one.
    ana_read: tokio::sync::Mutex<()>,
    /// Set by the shutdown: requests that complete are not submitted again.
    stopping: AtomicBool,
}

impl Events {
    pub fn new(context: EventContext, namespace: Option<Namespace>) -> Events {
        assert!(context.ana_log_bytes % 4 == 0 && context.ana_log_bytes <= ADMIN_TRANSFER_BYTES);
        let state = AsyncEventState { namespace, ..AsyncEventState::default() };
        Events {
            context,
            state: watch::Sender::new(state),
            ana_read: tokio::sync::Mutex::new(()),
            stopping: AtomicBool::new(false),
        }
    }

    pub fn snapshot(&self) -> AsyncEventState {
        self.state.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<AsyncEventState> {
        self.state.subscribe()
    }

    /// The ANA state of `nsid` through this controller: optimized without ANA reporting, else
    /// its group's state (the only group's when the log lists no NSIDs), else inaccessible.
    pub fn ana_state(&self, nsid: u32) -> AnaState {
        if !self.context.ana_reporting {
            return AnaState::Optimized;
        }
        let state = self.state.borrow();
        let groups = &state.ana_groups;
        let group = groups
            .iter()
            .find(|group| group.nsids.contains(&nsid))
            .or_else(|| (groups.len() == 1).then(|| &groups[0]));
        group.map_or(AnaState::Inaccessible, |group| group.state)
    }

    /// The controller's namespace as last identified.
    pub fn namespace(&self) -> Option<Namespace> {
        self.state.borrow().namespace
    }

    pub fn stop_rearming(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Applies `change`; bumps the generation (and wakes watchers) only if something changed.
    fn update(&self, change: impl FnOnce(&mut AsyncEventState)) {
        self.state.send_if_modified(|state| {
            let before = state.clone();
            change(state);
            let changed = *state != before;
            if changed {
                state.generation += 1;
            }
            changed
        });
    }

    /// Records why event handling ended; the first reason stays.
    fn record_stop(&self, reason: String) {
        self.update(|state| {
            state.stopped.get_or_insert(reason);
        });
    }
}

/// Enables the notices the controller offers among those this host handles, as
/// `nvme_enable_aen` does. Returns the configuration set; zero means no notice is offered and no
/// request is worth keeping. A refusal is logged and not fatal, as in Linux.
pub(crate) async fn enable(admin: &AdminQueue, oaes: u32) -> u32 {
    let wanted = oaes & ASYNC_EVENTS_WANTED;
    if wanted == 0 {
        return 0;
    }
    let sqe = Sqe::set_features(0, feature::ASYNC_EVENT_CONFIGURATION, wanted);
    let command = "Set Features Asynchronous Event Configuration";
    if let Err(error) = admin.execute(sqe, Submission::none(), command).await {
        tracing::warn!(address = %admin.address(), %error, "cannot enable asynchronous event notices");
    }
    wanted
}

/// How many requests to keep outstanding on a controller reporting `aerl` (0's based).
pub(crate) fn requests_for(aerl: u8) -> u16 {
    ASYNC_EVENT_REQUESTS.min(u16::from(aerl) + 1)
}

/// Starts the event task: it submits `requests` Asynchronous Event Requests and handles their
/// completions until the admin queue stops. It holds the admin queue weakly, so it never keeps
/// a dropped controller's connection open.
pub(crate) fn spawn(admin: WeakAdminQueue, events: Arc<Events>, requests: u16) -> AbortHandle {
    assert!((1..=ASYNC_EVENT_REQUESTS).contains(&requests));
    tokio::spawn(run(admin, events, requests)).abort_handle()
}

type Outstanding = JoinSet<Result<Completion, InitiatorError>>;

async fn run(admin: WeakAdminQueue, events: Arc<Events>, requests: u16) {
    let mut outstanding = Outstanding::new();
    for _ in 0..requests {
        if let Err(error) = arm(&admin, &events, &mut outstanding).await {
            events.record_stop(format!("cannot submit an Asynchronous Event Request: {error}"));
            break;
        }
    }
    while let Some(joined) = outstanding.join_next().await {
        events.update(|state| state.requests_outstanding -= 1);
        let completion = match joined {
            Ok(Ok(completion)) => completion,
            Ok(Err(error)) => {
                events.record_stop(format!("the admin queue stopped: {error}"));
                continue;
            }
            Err(error) => {
                events.record_stop(format!("the request's waiter ended: {error}"));
                continue;
            }
        };
        if !completion.status.is_success() {
            // The controller ended the request (Abort Requested, SQ deletion, ...): that ends
            // reporting on it; like Linux, the host does not submit it again.
            let status = completion.status;
            tracing::debug!(address = %events.context.address, status = status.raw(), "asynchronous event request ended");
            events.record_stop(format!(
                "the controller ended an Asynchronous Event Request with status {:#06x} ({})",
                status.raw(),
                status_name(status)
            ));
            continue;
        }
        let event = AsyncEvent::decode(completion.result as u32);
        events.update(|state| state.notices += 1);
        if let Some(admin) = admin.upgrade() {
            if let Err(error) = handle(&admin, &events, event).await {
                tracing::warn!(
                    address = %events.context.address, ?event, %error,
                    "handling an asynchronous event failed"
                );
            }
        }
        if events.stopping.load(Ordering::Acquire) {
            continue;
        }
        if let Err(error) = arm(&admin, &events, &mut outstanding).await {
            events.record_stop(format!("cannot submit an Asynchronous Event Request: {error}"));
        }
    }
}

/// Submits one Asynchronous Event Request; its completion joins `outstanding`.
async fn arm(
    admin: &WeakAdminQueue,
    events: &Events,
    outstanding: &mut Outstanding,
) -> Result<(), InitiatorError> {
    let Some(strong) = admin.upgrade() else {
        return Err(admin.broken());
    };
    let sqe = Sqe::async_event_request(0);
    let reply = strong.send(sqe, Submission::none(), "Asynchronous Event Request", true).await?;
    drop(strong);
    let weak = admin.clone();
    outstanding.spawn(async move { weak.wait(reply).await });
    events.update(|state| state.requests_outstanding += 1);
    Ok(())
}

/// Acts on one notice. Events this host does not handle are only logged; their requests are
/// submitted again all the same.
async fn handle(
    admin: &AdminQueue,
    events: &Events,
    event: AsyncEvent,
) -> Result<(), InitiatorError> {
    tracing::debug!(address = %events.context.address, ?event, "asynchronous event");
    if event.is_notice(notice::ANA_CHANGE) {
        read_ana_log(admin, events).await
    } else if event.is_notice(notice::NAMESPACE_ATTRIBUTE_CHANGED) {
        namespace_changed(admin, events).await
    } else {
        Ok(())
    }
}

/// A buffer of `length` bytes for a command that reads data.
fn read_into(length: usize) -> Submission {
    let mut buffer = AlignedBuf::new(length);
    buffer.set_len(length);
    Submission::data(Direction::FromController, buffer, true)
}

/// Reads the ANA log page (RAE 0, which clears the ANA change event) and records its groups.
/// Without ANA reporting there is nothing to read.
pub(crate) async fn read_ana_log(
    admin: &AdminQueue,
    events: &Events,
) -> Result<(), InitiatorError> {
    let context = &events.context;
    if !context.ana_reporting {
        return Ok(());
    }
    let _serialized = events.ana_read.lock().await;
    let length = context.ana_log_bytes;
    let sqe = Sqe::get_log_page(0, NSID_ALL, log_page::ANA, 0, length as u32);
    let completion = admin.execute(sqe, read_into(length), "Get Log Page (ANA)").await?;
    let data = completion.buffer.expect("a command that reads data returns its buffer");
    let groups = decode_ana_groups(&data).map_err(|problem| InitiatorError::Protocol {
        address: context.address,
        qid: 0,
        problem,
    })?;
    let change_count = AnaLog::decode(&data).map_or(0, |log| log.change_count);
    events.update(|state| {
        state.ana_change_count = change_count;
        state.ana_groups = groups;
    });
    Ok(())
}

/// The groups of an ANA log page, checked as Linux checks them: a group ID is not zero and a
/// state is one the specification defines.
fn decode_ana_groups(data: &[u8]) -> Result<Vec<AnaGroupState>, String> {
    let log = AnaLog::decode(data).ok_or_else(|| "the ANA log page is malformed".to_owned())?;
    log.groups
        .into_iter()
        .map(|group| {
            if group.grpid == 0 {
                return Err("the ANA log page lists a group with ID 0".to_owned());
            }
            let state = AnaState::from_code(group.state).ok_or_else(|| {
                format!("ANA group {} has the reserved state {:#x}", group.grpid, group.state)
            })?;
            Ok(AnaGroupState { grpid: group.grpid, state, nsids: group.nsids })
        })
        .collect()
}

/// Clears a namespace attribute notice by reading the Changed Namespace List (RAE 0), then
/// identifies the controller's namespace again, whatever the list says (Linux rescans too).
async fn namespace_changed(admin: &AdminQueue, events: &Events) -> Result<(), InitiatorError> {
    let length = CHANGED_NAMESPACE_LOG_BYTES;
    let sqe = Sqe::get_log_page(0, NSID_ALL, log_page::CHANGED_NAMESPACE_LIST, 0, length as u32);
    admin.execute(sqe, read_into(length), "Get Log Page (Changed Namespace List)").await?;
    let context = &events.context;
    let Some(nsid) = context.nsid else { return Ok(()) };
    let namespace = match identify_namespace(admin, &context.subnqn, nsid).await {
        Ok(namespace) => Some(namespace),
        Err(error @ InitiatorError::Namespace { .. }) => {
            tracing::warn!(address = %context.address, %error, "the namespace changed");
            None
        }
        Err(error) => return Err(error),
    };
    events.update(|state| state.namespace = namespace);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use nvmf::command::{admin_opcode, Status};
    use nvmf::structures::AnaGroup;

    use super::*;
    use crate::admin::tests::scripted_admin_queue;
    use crate::admin::AdminQueue;

    #[test]
    fn completion_dword_zero_decodes() {
        // Notice, ANA change, log page 0Ch: what the target sends.
        let ana = AsyncEvent::decode(0x000C_0302);
        assert_eq!(
            ana,
            AsyncEvent { event_type: event_type::NOTICE, information: 0x03, log_page: 0x0C }
        );
        assert!(ana.is_notice(notice::ANA_CHANGE));
        assert!(!ana.is_notice(notice::NAMESPACE_ATTRIBUTE_CHANGED));
        let namespace = AsyncEvent::decode(0x0004_0002);
        assert!(namespace.is_notice(notice::NAMESPACE_ATTRIBUTE_CHANGED));
        assert_eq!(namespace.log_page, log_page::CHANGED_NAMESPACE_LIST);
        // Reserved bits are ignored; a SMART event with the ANA code is no ANA notice.
        let smart = AsyncEvent::decode(0xFF0C_03F9);
        assert_eq!(smart.event_type, event_type::SMART_HEALTH);
        assert!(!smart.is_notice(notice::ANA_CHANGE));
    }

    #[test]
    fn requests_are_bounded_by_aerl() {
        assert_eq!(requests_for(0), 1);
        assert_eq!(requests_for(3), ASYNC_EVENT_REQUESTS.min(4));
        assert_eq!(requests_for(u8::MAX), ASYNC_EVENT_REQUESTS);
    }

    fn encoded(groups: Vec<AnaGroup>) -> Vec<u8> {
        let mut data = Vec::new();
        AnaLog { change_count: 7, groups }.encode(&mut data);
        data
    }

    fn group(grpid: u32, state: u8, nsids: Vec<u32>) -> AnaGroup {
        AnaGroup { grpid, change_count: 7, state, nsids }
    }

    #[test]
    fn ana_groups_are_checked() {
        use nvmf::structures::ana_state;
        let groups =
            decode_ana_groups(&encoded(vec![group(1, ana_state::NON_OPTIMIZED, vec![1, 2])]))
                .unwrap();
        assert_eq!(
            groups,
            [AnaGroupState { grpid: 1, state: AnaState::NonOptimized, nsids: vec![1, 2] }]
        );
        let zero = decode_ana_groups(&encoded(vec![group(0, ana_state::OPTIMIZED, vec![1])]));
        assert!(zero.unwrap_err().contains("ID 0"));
        let reserved = decode_ana_groups(&encoded(vec![group(1, 0x05, vec![1])]));
        assert!(reserved.unwrap_err().contains("reserved state 0x5"));
        assert!(decode_ana_groups(&[0u8; 8]).is_err());
    }

    fn events(ana_reporting: bool) -> Events {
        let context = EventContext {
            address: "127.0.0.1:4420".parse().unwrap(),
            subnqn: Nqn::new("nqn.2024-01.io.ferrite:vol:events").unwrap(),
            nsid: Some(1),
            ana_reporting,
            ana_log_bytes: 64,
        };
        Events::new(context, None)
    }

    #[test]
    fn ana_state_follows_the_groups_and_the_generation_only_real_changes() {
        assert_eq!(events(false).ana_state(1), AnaState::Optimized);
        let events = events(true);
        assert_eq!(events.ana_state(1), AnaState::Inaccessible, "no log read yet");
        let mut watcher = events.subscribe();
        let groups = vec![
            AnaGroupState { grpid: 1, state: AnaState::Optimized, nsids: vec![1] },
            AnaGroupState { grpid: 2, state: AnaState::Change, nsids: vec![2] },
        ];
        events.update(|state| state.ana_groups = groups.clone());
        assert!(watcher.has_changed().unwrap());
        assert_eq!(watcher.borrow_and_update().generation, 1);
        assert_eq!(events.ana_state(1), AnaState::Optimized);
        assert_eq!(events.ana_state(2), AnaState::Change);
        assert_eq!(events.ana_state(3), AnaState::Inaccessible);
        events.update(|state| state.ana_groups = groups.clone());
        assert!(!watcher.has_changed().unwrap(), "the same groups again are no change");
        // One group listing no NSIDs (read with RGO) covers every namespace.
        events.update(|state| {
            state.ana_groups =
                vec![AnaGroupState { grpid: 1, state: AnaState::NonOptimized, nsids: vec![] }]
        });
        assert_eq!(events.ana_state(9), AnaState::NonOptimized);
        events.record_stop("first".to_owned());
        events.record_stop("second".to_owned());
        assert_eq!(events.snapshot().stopped.as_deref(), Some("first"));
        assert_eq!(events.snapshot().generation, 3);
    }

    #[tokio::test]
    async fn an_aborted_request_ends_reporting_and_is_not_submitted_again() {
        let (queue, requests) = scripted_admin_queue(|sqe| {
            assert_eq!(sqe.opcode(), admin_opcode::ASYNC_EVENT_REQUEST);
            Some(Status::ABORT_REQUESTED)
        })
        .await;
        let (admin, driver) = AdminQueue::start(queue);
        let events = Arc::new(events(true));
        let task = spawn(admin.downgrade(), Arc::clone(&events), 1);
        let mut watcher = events.subscribe();
        let state = tokio::time::timeout(
            Duration::from_secs(10),
            watcher.wait_for(|state| state.stopped.is_some()),
        )
        .await
        .expect("the end of reporting is recorded")
        .unwrap()
        .clone();
        let stopped = state.stopped.unwrap();
        assert!(stopped.contains("Command Abort Requested"), "{stopped}");
        assert_eq!(state.requests_outstanding, 0);
        assert_eq!(state.notices, 0);
        // Time for a wrong resubmission to arrive; the admin queue still runs.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(requests.load(Ordering::SeqCst), 1, "the request was submitted again");
        assert_eq!(admin.stopped(), None);
        task.abort();
        driver.abort();
    }
}
