//! A connection to one NVMe controller over TCP: the admin queue and its bring-up (Connect, CAP,
//! CC.EN, CSTS.RDY, Identify, Number of Queues, asynchronous event notices and the first ANA log
//! page), the keep-alive task, the asynchronous event task, namespace identification, the
//! opening of I/O queues and the orderly shutdown.
//!
//! The admin queue belongs to its driver task (`admin.rs`); the caller, the keep-alive task and
//! the event task (`events.rs`) send it commands, which run concurrently, so the Asynchronous
//! Event Request that stays outstanding never holds up another command. Each I/O queue holds the
//! controller's shared state, so the admin connection (and the keep-alive that keeps the
//! controller alive on the target) lasts as long as the [`Controller`] or any of its
//! [`IoQueue`]s; when the last goes, its tasks are aborted and the connection closes.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use nvmf::command::{
    cns, csi, feature, property, ConnectData, PropertySize, Sqe, CNTLID_DYNAMIC,
    CONNECT_DATA_BYTES, SQE_BYTES,
};
use nvmf::structures::{
    cmic, IdentifyController, IdentifyNamespace, ANA_GROUP_DESCRIPTOR_BYTES, ANA_LOG_HEADER_BYTES,
    IDENTIFY_BYTES,
};
use nvmf::target::AnaState;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use types::{AlignedBuf, Nqn};

use crate::admin::AdminQueue;
use crate::error::InitiatorError;
use crate::events::{self, AnaGroupState, AsyncEventState, EventContext, Events};
use crate::host::{default_host, HostIdentity};
use crate::io_queue::IoQueue;
use crate::queue::{
    duration_ms, Completion, Direction, QueuePair, QueueParams, Submission, ADMIN_IN_CAPSULE_BYTES,
    ADMIN_QUEUE_DEPTH, COMMAND_TRANSFER_BYTES_MAX, QUEUE_DEPTH_MAX,
};

/// The fewest entries an I/O submission queue may have (SQSIZE 1, 0's based).
const IO_QUEUE_ENTRIES_MIN: u16 = 2;

/// Keep Alive Timeout asked for in the admin Connect unless the caller says otherwise.
pub const KEEP_ALIVE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// Time allowed for resolving the address, the TCP connect and ICReq/ICResp.
pub const CONNECT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
/// Time allowed for the controller to answer any one command (no byte received meanwhile).
pub const COMMAND_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// I/O queues asked for with Set Features Number of Queues.
pub const IO_QUEUES_REQUESTED_DEFAULT: u16 = 64;
/// Bounds on the wait for CSTS.RDY, whatever CAP.TO says.
pub const READY_TIMEOUT_MIN: Duration = Duration::from_millis(500);
pub const READY_TIMEOUT_MAX: Duration = Duration::from_secs(60);
/// Interval between CSTS reads while waiting for ready or for shutdown.
pub const STATUS_POLL_INTERVAL: Duration = Duration::from_millis(10);
/// Time allowed for a normal shutdown (CC.SHN) to report CSTS.SHST complete.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
/// Pages of the active namespace list read at most (1024 NSIDs each).
pub const ACTIVE_NAMESPACE_PAGES_MAX: usize = 16;
/// Largest data moved by one admin command: Identify is 4096 bytes and log pages are read in
/// pieces of this size.
pub const ADMIN_TRANSFER_BYTES: usize = IDENTIFY_BYTES;
/// Smallest and largest logical block sizes accepted (LBADS 9 to 16).
const LBA_DATA_SIZE_LOG2_MIN: u8 = 9;
const LBA_DATA_SIZE_LOG2_MAX: u8 = 16;
/// CAP.TO is in units of 500 ms.
const CAP_TIMEOUT_UNIT: Duration = Duration::from_millis(500);
/// CC.SHN = 01b: normal shutdown.
const CC_SHUTDOWN_NORMAL: u32 = 1 << property::CC_SHN_SHIFT;
/// I/O queue entry sizes written to CC: 2^6 = 64-byte SQEs, 2^4 = 16-byte CQEs.
const CC_IOSQES: u32 = 6;
const CC_IOCQES: u32 = 4;

const _: () = assert!(ADMIN_TRANSFER_BYTES <= COMMAND_TRANSFER_BYTES_MAX);
const _: () = assert!(CONNECT_DATA_BYTES <= ADMIN_IN_CAPSULE_BYTES);

/// How to connect. `Default` gives this process's host identity, no digests, a 10 s keep-alive
/// timeout and the default timeouts.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The host NQN and host identifier; `None`: [`default_host`], the same for the whole process.
    pub host: Option<HostIdentity>,
    pub header_digest: bool,
    pub data_digest: bool,
    /// KATO sent in the admin Connect; the keep-alive task sends Keep Alive every half of it.
    /// Zero disables keep-alive (fine for short discovery connections).
    pub keep_alive_timeout: Duration,
    /// I/O queues asked for (Set Features Number of Queues); the controller may grant fewer.
    pub io_queues_requested: u16,
    /// R2Ts accepted outstanding per command (ICReq MAXR2T + 1).
    pub r2t_outstanding_max: u32,
    /// The namespace [`Controller::open_io_queue`] uses; `None`: the first active namespace.
    pub nsid: Option<u32>,
    pub connect_timeout: Duration,
    pub command_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            host: None,
            header_digest: false,
            data_digest: false,
            keep_alive_timeout: KEEP_ALIVE_TIMEOUT_DEFAULT,
            io_queues_requested: IO_QUEUES_REQUESTED_DEFAULT,
            r2t_outstanding_max: 1,
            nsid: None,
            connect_timeout: CONNECT_TIMEOUT_DEFAULT,
            command_timeout: COMMAND_TIMEOUT_DEFAULT,
        }
    }
}

/// A namespace as Identify Namespace describes it, with the LBA format in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Namespace {
    pub nsid: u32,
    /// NSZE: the size in logical blocks.
    pub size_blocks: u64,
    /// NCAP: blocks that may be allocated (thin provisioning reports it).
    pub capacity_blocks: u64,
    pub lba_size_bytes: u32,
}

impl Namespace {
    pub fn size_bytes(&self) -> u64 {
        self.size_blocks.saturating_mul(u64::from(self.lba_size_bytes))
    }
}

/// ANA log page bytes read at least: the header and one group descriptor with a few NSIDs.
const ANA_LOG_BYTES_MIN: usize = 64;
/// Bytes of one NSID in an ANA group descriptor.
const ANA_NSID_BYTES: usize = 4;

/// A connected, enabled controller. Dropping it (and every [`IoQueue`] opened from it) closes
/// the connections; [`Controller::shutdown`] first tells the controller to shut down cleanly.
#[derive(Debug)]
pub struct Controller {
    shared: Arc<Shared>,
}

/// What the controller's queues share: the admin queue and what bring-up learned.
#[derive(Debug)]
pub(crate) struct Shared {
    admin: AdminQueue,
    pub address: SocketAddr,
    pub subnqn: Nqn,
    pub host: HostIdentity,
    pub options: ConnectOptions,
    pub cntlid: u16,
    /// CAP.MQES + 1: the deepest queue the controller allows.
    pub queue_entries_max: u16,
    cc: u32,
    pub identify: IdentifyController,
    /// Write data up to this size goes in the I/O command capsule.
    pub in_capsule_bytes_max: usize,
    /// Largest transfer of one command (MDTS, bounded by [`COMMAND_TRANSFER_BYTES_MAX`]).
    pub transfer_bytes_max: usize,
    pub io_queues_allowed: u16,
    next_qid: AtomicU16,
    namespace: Option<Namespace>,
    /// What asynchronous events and ANA log reads have told the host.
    events: Arc<Events>,
    keep_alive_task: OnceLock<TaskGuard>,
    keep_alive_error: Mutex<Option<String>>,
    /// The asynchronous event task, when the controller offers notices this host handles.
    _event_task: Option<TaskGuard>,
    /// Declared last: the driver is aborted after the other tasks.
    _admin_task: TaskGuard,
}

impl Shared {
    pub fn current_namespace(&self) -> Option<Namespace> {
        self.events.namespace()
    }
}

/// Aborts a task the controller owns when the controller goes.
#[derive(Debug)]
struct TaskGuard(AbortHandle);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Controller {
    /// Connects to the I/O controller of `subnqn` at `address` (`"127.0.0.1:4420"`, a
    /// `SocketAddr`, `"host:port"`): TCP, ICReq, Connect, enable, Identify, Number of Queues,
    /// and the first active namespace (or `options.nsid`). Starts the keep-alive task.
    pub async fn connect<A>(
        address: A,
        subnqn: &Nqn,
        options: ConnectOptions,
    ) -> Result<Controller, InitiatorError>
    where
        A: tokio::net::ToSocketAddrs + std::fmt::Display,
    {
        Controller::connect_any(address, subnqn, options, false).await
    }

    /// Connects to the discovery controller at `address` (no namespaces, no I/O queues).
    pub async fn connect_discovery<A>(
        address: A,
        options: ConnectOptions,
    ) -> Result<Controller, InitiatorError>
    where
        A: tokio::net::ToSocketAddrs + std::fmt::Display,
    {
        Controller::connect_any(address, &Nqn::discovery(), options, true).await
    }

    /// Tries each address `address` resolves to until one accepts the TCP connection.
    async fn connect_any<A>(
        address: A,
        subnqn: &Nqn,
        options: ConnectOptions,
        discovery: bool,
    ) -> Result<Controller, InitiatorError>
    where
        A: tokio::net::ToSocketAddrs + std::fmt::Display,
    {
        let addresses = resolve(address, options.connect_timeout).await?;
        let mut last_error = None;
        for address in addresses {
            match Controller::connect_to(address, subnqn, options.clone(), discovery).await {
                Ok(controller) => return Ok(controller),
                Err(
                    error
                    @ (InitiatorError::ConnectRefused { .. } | InitiatorError::Connect { .. }),
                ) => last_error = Some(error),
                Err(error) => return Err(error),
            }
        }
        Err(last_error.expect("resolve returns at least one address"))
    }

    /// Bring-up at one address. A discovery controller gets no Number of Queues, no namespace
    /// lookup and no keep-alive unless asked.
    async fn connect_to(
        address: SocketAddr,
        subnqn: &Nqn,
        options: ConnectOptions,
        discovery: bool,
    ) -> Result<Controller, InitiatorError> {
        assert!(options.io_queues_requested >= 1, "ask for at least one I/O queue");
        let host = options.host.clone().unwrap_or_else(|| default_host().clone());
        let mut admin = QueuePair::open(QueueParams {
            address,
            qid: 0,
            depth: ADMIN_QUEUE_DEPTH,
            in_capsule_bytes_max: ADMIN_IN_CAPSULE_BYTES,
            transfer_bytes_max: ADMIN_TRANSFER_BYTES,
            header_digest: options.header_digest,
            data_digest: options.data_digest,
            r2t_outstanding_max: options.r2t_outstanding_max,
            connect_timeout: options.connect_timeout,
            command_timeout: options.command_timeout,
        })
        .await?;
        let kato_ms = u32::try_from(options.keep_alive_timeout.as_millis()).unwrap_or(u32::MAX);
        let cntlid = fabrics_connect(
            &mut admin,
            subnqn,
            &host,
            ADMIN_QUEUE_DEPTH - 1,
            kato_ms,
            CNTLID_DYNAMIC,
        )
        .await?;
        // From here on the admin queue belongs to its driver; a failed bring-up drops the guard
        // and with it the connection.
        let (admin, admin_task) = AdminQueue::start(admin);
        let admin_task = TaskGuard(admin_task);

        let cap =
            property_get(&admin, property::CAP, PropertySize::Bytes8, "Property Get CAP").await?;
        let queue_entries_max = (cap & 0xFFFF) as u16 + 1;
        let ready_timeout = (CAP_TIMEOUT_UNIT * ((cap >> 24) & 0xFF) as u32)
            .clamp(READY_TIMEOUT_MIN, READY_TIMEOUT_MAX);
        let mps_min = ((cap >> 48) & 0xF) as u32;
        let cc = property::CC_ENABLE
            | (mps_min << property::CC_MPS_SHIFT)
            | (CC_IOSQES << property::CC_IOSQES_SHIFT)
            | (CC_IOCQES << property::CC_IOCQES_SHIFT);
        property_set(&admin, property::CC, u64::from(cc), "Property Set CC").await?;
        let ready = wait_status(&admin, ready_timeout, "enabling the controller", |csts| {
            csts & property::CSTS_READY != 0
        })
        .await?;
        if !ready {
            return Err(InitiatorError::ControllerNotReady {
                address,
                timeout_ms: duration_ms(ready_timeout),
            });
        }

        let data = identify(&admin, cns::CONTROLLER, 0, "Identify Controller").await?;
        let identify = IdentifyController::decode(&data)
            .ok_or_else(|| protocol(address, "short Identify Controller data"))?;
        let page_bytes = 4096u64 << mps_min;
        let transfer_bytes_max = match identify.mdts {
            0 => COMMAND_TRANSFER_BYTES_MAX,
            mdts => page_bytes.checked_shl(u32::from(mdts)).map_or(
                COMMAND_TRANSFER_BYTES_MAX,
                |bytes| {
                    usize::try_from(bytes).unwrap_or(usize::MAX).min(COMMAND_TRANSFER_BYTES_MAX)
                },
            ),
        };
        // IOCCSZ counts the SQE; TCP puts in-capsule data right after it (ICDOFF 0). A controller
        // that asks for an offset gets no in-capsule data at all.
        let in_capsule_bytes_max = if identify.icdoff == 0 {
            (identify.ioccsz as usize * 16).saturating_sub(SQE_BYTES)
        } else {
            0
        };

        let io_queues_allowed = if discovery {
            0
        } else {
            let wanted = u32::from(options.io_queues_requested - 1);
            let sqe = Sqe::set_features(0, feature::NUMBER_OF_QUEUES, wanted | (wanted << 16));
            let completion =
                admin.execute(sqe, Submission::none(), "Set Features Number of Queues").await?;
            let dw0 = completion.result as u32;
            let granted = (dw0 & 0xFFFF).min(dw0 >> 16) as u16;
            granted.saturating_add(1).min(options.io_queues_requested)
        };

        let mut namespace = None;
        if !discovery {
            let nsid = match options.nsid {
                Some(nsid) => Some(nsid),
                None => active_namespaces(&admin, address).await?.first().copied(),
            };
            if let Some(nsid) = nsid {
                namespace = Some(identify_namespace(&admin, subnqn, nsid).await?);
            }
        }

        // Asynchronous events, as Linux's nvme_start_ctrl: enable the notices, keep requests
        // outstanding, then read the ANA states (after enabling, so no change is missed). A
        // discovery controller gets none of it.
        let events = Arc::new(Events::new(
            EventContext {
                address,
                subnqn: subnqn.clone(),
                nsid: namespace.map(|namespace| namespace.nsid),
                ana_reporting: !discovery && identify.cmic & cmic::ANA_REPORTING != 0,
                ana_log_bytes: ana_log_bytes(&identify),
            },
            namespace,
        ));
        let mut event_task = None;
        if !discovery && events::enable(&admin, identify.oaes).await != 0 {
            let requests = events::requests_for(identify.aerl);
            event_task =
                Some(TaskGuard(events::spawn(admin.downgrade(), Arc::clone(&events), requests)));
        }
        events::read_ana_log(&admin, &events).await?;

        let shared = Arc::new(Shared {
            admin,
            address,
            subnqn: subnqn.clone(),
            host,
            options,
            cntlid,
            queue_entries_max,
            cc,
            identify,
            in_capsule_bytes_max,
            transfer_bytes_max,
            io_queues_allowed,
            next_qid: AtomicU16::new(1),
            namespace,
            events,
            keep_alive_task: OnceLock::new(),
            keep_alive_error: Mutex::new(None),
            _event_task: event_task,
            _admin_task: admin_task,
        });
        if !shared.options.keep_alive_timeout.is_zero() {
            let task =
                spawn_keep_alive(Arc::downgrade(&shared), shared.options.keep_alive_timeout / 2);
            shared.keep_alive_task.set(TaskGuard(task)).expect("the keep-alive task starts once");
        }
        tracing::debug!(%address, %subnqn, cntlid, "controller connected");
        Ok(Controller { shared })
    }

    pub fn address(&self) -> SocketAddr {
        self.shared.address
    }

    pub fn subnqn(&self) -> &Nqn {
        &self.shared.subnqn
    }

    pub fn host(&self) -> &HostIdentity {
        &self.shared.host
    }

    /// The controller ID the target assigned in the admin Connect.
    pub fn cntlid(&self) -> u16 {
        self.shared.cntlid
    }

    /// Identify Controller as read at connect (MDTS, IOCCSZ, SUBNQN, SN, MN, CNTLID, NN, ...).
    pub fn identify_controller(&self) -> &IdentifyController {
        &self.shared.identify
    }

    /// The deepest I/O queue the controller allows (CAP.MQES + 1), within [`QUEUE_DEPTH_MAX`].
    pub fn queue_depth_max(&self) -> u16 {
        self.shared.queue_entries_max.min(QUEUE_DEPTH_MAX)
    }

    /// Largest data of one command; longer reads and writes are split.
    pub fn transfer_bytes_max(&self) -> usize {
        self.shared.transfer_bytes_max
    }

    /// Largest write sent in the command capsule; longer ones wait for R2T.
    pub fn in_capsule_bytes_max(&self) -> usize {
        self.shared.in_capsule_bytes_max
    }

    /// I/O queues the controller granted.
    pub fn io_queues_allowed(&self) -> u16 {
        self.shared.io_queues_allowed
    }

    /// The namespace [`Controller::open_io_queue`] uses, found at connect.
    pub fn namespace(&self) -> Option<&Namespace> {
        self.shared.namespace.as_ref()
    }

    /// Why the keep-alive task stopped, if it failed (the controller is then likely gone).
    pub fn keep_alive_error(&self) -> Option<String> {
        self.shared.keep_alive_error.lock().unwrap_or_else(|poison| poison.into_inner()).clone()
    }

    /// Identify Namespace `nsid`: its size and logical block size.
    pub async fn identify_namespace(&self, nsid: u32) -> Result<Namespace, InitiatorError> {
        identify_namespace(&self.shared.admin, &self.shared.subnqn, nsid).await
    }

    /// The active namespace IDs, in increasing order.
    pub async fn active_namespaces(&self) -> Result<Vec<u32>, InitiatorError> {
        active_namespaces(&self.shared.admin, self.shared.address).await
    }

    /// The namespace of [`Controller::namespace`] as last identified: namespace attribute
    /// notices update its size. `None` without a namespace, or once it is no longer usable.
    pub fn current_namespace(&self) -> Option<Namespace> {
        self.shared.current_namespace()
    }

    /// The ANA state of namespace `nsid` through this controller, as the last ANA log page read
    /// reported it (ANA change notices and [`Controller::refresh_ana`] read it); optimized when
    /// the controller does not report ANA.
    pub fn ana_state(&self, nsid: u32) -> AnaState {
        self.shared.events.ana_state(nsid)
    }

    /// Every ANA group of the last ANA log page read; empty without ANA reporting.
    pub fn ana_states(&self) -> Vec<AnaGroupState> {
        self.shared.events.snapshot().ana_groups
    }

    /// Reads the ANA log page now (as Linux does after an I/O fails with an ANA status) and
    /// records the states it reports.
    pub async fn refresh_ana(&self) -> Result<(), InitiatorError> {
        events::read_ana_log(&self.shared.admin, &self.shared.events).await
    }

    /// What asynchronous events have told the host so far, with its generation.
    pub fn async_events(&self) -> AsyncEventState {
        self.shared.events.snapshot()
    }

    /// A receiver that wakes on every change of [`Controller::async_events`].
    pub fn watch_async_events(&self) -> watch::Receiver<AsyncEventState> {
        self.shared.events.subscribe()
    }

    /// Whether the admin queue still runs; `false` once its connection broke or the controller
    /// ended it (the controller is then unusable).
    pub fn is_live(&self) -> bool {
        self.shared.admin.stopped().is_none()
    }

    /// Runs one admin command (for log pages and features not wrapped here); `data` is the
    /// buffer of a command that reads data (its length is the transfer length).
    pub async fn admin_command(
        &self,
        sqe: Sqe,
        data: Option<AlignedBuf>,
        command: &'static str,
    ) -> Result<Completion, InitiatorError> {
        let submission = match data {
            Some(buffer) => Submission::data(Direction::FromController, buffer, true),
            None => Submission::none(),
        };
        self.shared.admin.execute(sqe, submission, command).await
    }

    /// Opens an I/O queue of `depth` commands on the controller's namespace.
    pub async fn open_io_queue(&self, depth: u16) -> Result<IoQueue, InitiatorError> {
        let namespace = self
            .shared
            .namespace
            .ok_or_else(|| InitiatorError::NoNamespace { subnqn: self.shared.subnqn.clone() })?;
        self.open_io_queue_for(namespace, depth).await
    }

    /// Opens an I/O queue of `depth` commands (1 to [`Controller::queue_depth_max`]) on its own
    /// TCP connection, for `namespace`.
    pub async fn open_io_queue_for(
        &self,
        namespace: Namespace,
        depth: u16,
    ) -> Result<IoQueue, InitiatorError> {
        let shared = &self.shared;
        let depth_max = self.queue_depth_max();
        if depth == 0 || depth > depth_max {
            return Err(InitiatorError::InvalidRequest(format!(
                "queue depth {depth}: the controller at {} allows 1 to {depth_max}",
                shared.address
            )));
        }
        let lba_size_bytes = namespace.lba_size_bytes as usize;
        let transfer_bytes_max = shared.transfer_bytes_max / lba_size_bytes * lba_size_bytes;
        if transfer_bytes_max == 0 {
            return Err(InitiatorError::Namespace {
                subnqn: shared.subnqn.clone(),
                nsid: namespace.nsid,
                problem: format!(
                    "its {lba_size_bytes}-byte blocks exceed the controller's {}-byte transfer limit",
                    shared.transfer_bytes_max
                ),
            });
        }
        let allowed = shared.io_queues_allowed;
        let qid = shared
            .next_qid
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |qid| {
                (qid <= allowed).then_some(qid + 1)
            })
            .map_err(|_| InitiatorError::TooManyQueues {
                address: shared.address,
                cntlid: shared.cntlid,
                allowed,
            })?;
        let mut queue = QueuePair::open(QueueParams {
            address: shared.address,
            qid,
            depth,
            // The Connect data goes in the capsule when IOCCSZ allows, else by R2T.
            in_capsule_bytes_max: shared.in_capsule_bytes_max,
            transfer_bytes_max,
            header_digest: shared.options.header_digest,
            data_digest: shared.options.data_digest,
            r2t_outstanding_max: shared.options.r2t_outstanding_max,
            connect_timeout: shared.options.connect_timeout,
            command_timeout: shared.options.command_timeout,
        })
        .await?;
        // SQSIZE is 0's based and at least 1 (a queue has two entries or more), so a queue of
        // depth 1 asks for two entries and still keeps one command in flight. KATO is reserved
        // in I/O queue Connects.
        let sqsize = depth.max(IO_QUEUE_ENTRIES_MIN) - 1;
        let cntlid =
            fabrics_connect(&mut queue, &shared.subnqn, &shared.host, sqsize, 0, shared.cntlid)
                .await?;
        if cntlid != shared.cntlid {
            return Err(protocol(
                shared.address,
                &format!("I/O queue {qid} joined controller {cntlid}, not {}", shared.cntlid),
            ));
        }
        Ok(IoQueue::new(queue, namespace, Arc::clone(&self.shared)))
    }

    /// Shuts the controller down cleanly (CC.SHN normal, then waits for CSTS.SHST complete) and
    /// drops it. I/O queues still open stop working. Outstanding Asynchronous Event Requests do
    /// not delay it: they end with the connection and are not submitted again.
    pub async fn shutdown(self) -> Result<(), InitiatorError> {
        if let Some(task) = self.shared.keep_alive_task.get() {
            task.0.abort();
        }
        self.shared.events.stop_rearming();
        let admin = &self.shared.admin;
        let cc = (self.shared.cc & !(property::CC_SHN_MASK << property::CC_SHN_SHIFT))
            | CC_SHUTDOWN_NORMAL;
        property_set(admin, property::CC, u64::from(cc), "Property Set CC (shutdown)").await?;
        let done = wait_status(admin, SHUTDOWN_TIMEOUT, "shutting down", |csts| {
            csts & property::CSTS_SHST_MASK == property::CSTS_SHST_COMPLETE
        })
        .await?;
        if !done {
            let timeout_ms = duration_ms(SHUTDOWN_TIMEOUT);
            return Err(InitiatorError::ShutdownTimeout {
                address: self.shared.address,
                timeout_ms,
            });
        }
        Ok(())
    }
}

/// Resolves `address` to at least one socket address.
async fn resolve<A>(address: A, timeout: Duration) -> Result<Vec<SocketAddr>, InitiatorError>
where
    A: tokio::net::ToSocketAddrs + std::fmt::Display,
{
    let text = address.to_string();
    let resolve_error = |source| InitiatorError::Resolve { address: text.clone(), source };
    let found = match tokio::time::timeout(timeout, tokio::net::lookup_host(address)).await {
        Err(_) => {
            return Err(resolve_error(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "name resolution timed out",
            )))
        }
        Ok(result) => result.map_err(resolve_error)?,
    };
    let addresses: Vec<SocketAddr> = found.collect();
    if addresses.is_empty() {
        return Err(resolve_error(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no address found",
        )));
    }
    Ok(addresses)
}

fn protocol(address: SocketAddr, problem: &str) -> InitiatorError {
    InitiatorError::Protocol { address, qid: 0, problem: problem.to_owned() }
}

/// Bytes of the ANA log page to read: the header, a descriptor per group and an entry per
/// namespace the controller may have, in whole dwords, within one admin transfer (as Linux sizes
/// its ANA log buffer).
fn ana_log_bytes(identify: &IdentifyController) -> usize {
    let namespaces = identify.mnan.max(identify.nn) as usize;
    let wanted = ANA_LOG_HEADER_BYTES
        .saturating_add(ANA_GROUP_DESCRIPTOR_BYTES.saturating_mul(identify.nanagrpid as usize))
        .saturating_add(ANA_NSID_BYTES.saturating_mul(namespaces));
    wanted.clamp(ANA_LOG_BYTES_MIN, ADMIN_TRANSFER_BYTES).next_multiple_of(4)
}

/// Fabrics Connect on `queue` (its qid is in its parameters); returns the controller ID.
async fn fabrics_connect(
    queue: &mut QueuePair,
    subnqn: &Nqn,
    host: &HostIdentity,
    sqsize: u16,
    kato_ms: u32,
    cntlid: u16,
) -> Result<u16, InitiatorError> {
    let data = ConnectData {
        host_id: host.host_id,
        cntlid,
        subnqn: subnqn.clone(),
        hostnqn: host.nqn.clone(),
    };
    let mut encoded = Vec::with_capacity(CONNECT_DATA_BYTES);
    data.encode(&mut encoded);
    let mut buffer = AlignedBuf::new(CONNECT_DATA_BYTES);
    buffer.set_len(CONNECT_DATA_BYTES);
    buffer.copy_from_slice(&encoded);
    let QueueParams { address, qid, .. } = *queue.params();
    let sqe = Sqe::connect(0, qid, sqsize, kato_ms);
    let submission = Submission::data(Direction::ToController, buffer, false);
    let completion = queue.execute(sqe, submission, "the Fabrics Connect").await?;
    let dw0 = completion.result as u32;
    if !completion.status.is_success() {
        return Err(InitiatorError::ConnectRejected {
            address,
            subnqn: subnqn.clone(),
            qid,
            status: completion.status,
            result: dw0,
        });
    }
    if dw0 >> 16 != 0 {
        let problem = format!(
            "the subsystem {subnqn} requires in-band authentication, which this initiator lacks"
        );
        return Err(InitiatorError::Unsupported { address, problem });
    }
    Ok(dw0 as u16)
}

async fn property_get(
    admin: &AdminQueue,
    offset: u32,
    size: PropertySize,
    command: &'static str,
) -> Result<u64, InitiatorError> {
    let completion =
        admin.execute(Sqe::property_get(0, offset, size), Submission::none(), command).await?;
    Ok(match size {
        PropertySize::Bytes4 => completion.result & 0xFFFF_FFFF,
        PropertySize::Bytes8 => completion.result,
    })
}

async fn property_set(
    admin: &AdminQueue,
    offset: u32,
    value: u64,
    command: &'static str,
) -> Result<(), InitiatorError> {
    let sqe = Sqe::property_set(0, offset, PropertySize::Bytes4, value);
    admin.execute(sqe, Submission::none(), command).await.map(drop)
}

/// Reads CSTS until `done` says so (`true`), CFS is set (an error) or `timeout` passes (`false`).
async fn wait_status(
    admin: &AdminQueue,
    timeout: Duration,
    during: &'static str,
    done: impl Fn(u32) -> bool,
) -> Result<bool, InitiatorError> {
    let address = admin.address();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let csts = property_get(admin, property::CSTS, PropertySize::Bytes4, "Property Get CSTS")
            .await? as u32;
        if csts & property::CSTS_FATAL != 0 {
            return Err(InitiatorError::ControllerFatal { address, during });
        }
        if done(csts) {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(STATUS_POLL_INTERVAL).await;
    }
}

/// Identify with CNS `cns` for `nsid`: the 4096 bytes.
async fn identify(
    admin: &AdminQueue,
    cns: u8,
    nsid: u32,
    command: &'static str,
) -> Result<AlignedBuf, InitiatorError> {
    let sqe = Sqe::identify(0, cns, nsid, csi::NVM, IDENTIFY_BYTES as u32);
    let buffer = AlignedBuf::new(IDENTIFY_BYTES);
    let completion = admin
        .execute(sqe, Submission::data(Direction::FromController, buffer, true), command)
        .await?;
    Ok(completion.buffer.expect("a command that reads data returns its buffer"))
}

/// Identify Namespace `nsid`, checked to be a namespace this initiator can use.
pub(crate) async fn identify_namespace(
    admin: &AdminQueue,
    subnqn: &Nqn,
    nsid: u32,
) -> Result<Namespace, InitiatorError> {
    let data = identify(admin, cns::NAMESPACE, nsid, "Identify Namespace").await?;
    let unusable =
        |problem: String| InitiatorError::Namespace { subnqn: subnqn.clone(), nsid, problem };
    let Some(fields) = IdentifyNamespace::decode(&data) else {
        return Err(unusable("short Identify Namespace data".to_owned()));
    };
    if fields.nsze == 0 {
        return Err(unusable("it is not active (Identify Namespace reports size 0)".to_owned()));
    }
    let index = nvmf::structures::lba_format_index(fields.flbas, fields.nlbaf);
    let format = match nvmf::structures::lba_format(&data, index) {
        Some(format) if index <= usize::from(fields.nlbaf) => format,
        _ => {
            return Err(unusable(format!(
                "FLBAS selects LBA format {index}, which it does not list"
            )))
        }
    };
    if format.metadata_bytes != 0 {
        return Err(unusable(format!(
            "it carries {} bytes of metadata per block, which this initiator does not support",
            format.metadata_bytes
        )));
    }
    if !(LBA_DATA_SIZE_LOG2_MIN..=LBA_DATA_SIZE_LOG2_MAX).contains(&format.lba_data_size_log2) {
        return Err(unusable(format!(
            "its LBA data size 2^{} is not supported",
            format.lba_data_size_log2
        )));
    }
    Ok(Namespace {
        nsid,
        size_blocks: fields.nsze,
        capacity_blocks: fields.ncap,
        lba_size_bytes: 1 << format.lba_data_size_log2,
    })
}

async fn active_namespaces(
    admin: &AdminQueue,
    address: SocketAddr,
) -> Result<Vec<u32>, InitiatorError> {
    let mut nsids: Vec<u32> = Vec::new();
    for _ in 0..ACTIVE_NAMESPACE_PAGES_MAX {
        let after = nsids.last().copied().unwrap_or(0);
        let data =
            identify(admin, cns::ACTIVE_NAMESPACE_LIST, after, "Identify Active Namespace List")
                .await?;
        let page = nvmf::structures::decode_active_namespace_list(&data).ok_or_else(|| {
            protocol(address, "the active namespace list is not in increasing order")
        })?;
        if page.first().is_some_and(|first| *first <= after) {
            return Err(protocol(
                address,
                "the active namespace list repeats namespaces of the previous page",
            ));
        }
        let full = page.len() == nvmf::structures::ACTIVE_NAMESPACE_LIST_ENTRIES;
        nsids.extend(page);
        if !full {
            break;
        }
    }
    Ok(nsids)
}

/// Sends Keep Alive every `interval` until the controller is dropped or a Keep Alive fails.
fn spawn_keep_alive(shared: Weak<Shared>, interval: Duration) -> AbortHandle {
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            let Some(shared) = shared.upgrade() else { return };
            let result =
                shared.admin.execute(Sqe::keep_alive(0), Submission::none(), "Keep Alive").await;
            if let Err(error) = result {
                tracing::warn!(address = %shared.address, cntlid = shared.cntlid, %error, "keep-alive failed");
                *shared.keep_alive_error.lock().unwrap_or_else(|poison| poison.into_inner()) =
                    Some(error.to_string());
                return;
            }
        }
    });
    task.abort_handle()
}
