//! The NVMe/TCP target: the subsystem catalog, the controller registry and the per-connection
//! queue state machines, sans-IO.
//!
//! One [`Target`] serves a node's NVMe/TCP port. It is shared by every connection (`Arc`), holds
//! the catalog the node supplies (one subsystem per volume, one namespace per subsystem) and the
//! registry of live controllers. The dynamic controller model is used: every admin queue Connect
//! creates a controller with a fresh controller ID, and I/O queue Connects join it by that ID. The
//! well-known discovery subsystem is served on the same port.
//!
//! Each TCP connection is one [`Queue`] (see `queue.rs`); the node's driver feeds it received
//! bytes and moves storage requests and output bytes.
//!
//! A subsystem is reachable through every listener (port). The target keeps each subsystem's
//! ANA state per port ([`Target::set_ana_state`]), and asks the catalog which hosts may use a
//! subsystem ([`Catalog::host_allowed`]) at Connect and when it builds a host's discovery log. The registry lock is taken only on Connect
//! and on queue teardown, never per I/O; the namespace size is read through an atomic so a resize
//! is seen without locks.
//!
//! **Architecture Invariant:** nothing here touches sockets, files, clocks or threads.

mod admin;
#[cfg(test)]
mod conformance;
mod io;
mod pool;
mod queue;
#[cfg(test)]
mod replay;
#[cfg(test)]
mod tests;

pub use queue::{
    DeallocateRanges, Queue, RequestId, StorageOperation, StorageRequest, StorageStatus, Terminated,
};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use types::Nqn;

use crate::command::{
    connect_invalid_parameter_result, ConnectData, Status, CNTLID_MAX, SQE_BYTES,
};
use crate::pdu::{DIGEST_BYTES, PDU_HEADER_BYTES_MAX};
use crate::structures::{
    adrfam, subtype, treq, trtype, DiscoveryLogEntry, DiscoveryLogHeader,
    DISCOVERY_LOG_RECORD_BYTES,
};

/// Entries in the largest submission queue a host may create (CAP.MQES + 1).
pub const QUEUE_ENTRIES_MAX: u16 = 128;
/// Most I/O queues per controller.
pub const IO_QUEUES_MAX: u16 = 64;
/// Maximum Data Transfer Size as a power of two of the 4 KiB minimum page size (CAP.MPSMIN = 0).
pub const MDTS: u8 = 8;
/// Largest data transfer of one command: 1 MiB.
pub const TRANSFER_BYTES_MAX: u32 = 4096 << MDTS;
/// Largest in-capsule data of a command.
pub const IN_CAPSULE_DATA_BYTES_MAX: u32 = 8192;
/// I/O queue command capsule size in 16-byte units: the SQE plus in-capsule data.
pub const IOCCSZ: u32 = (SQE_BYTES as u32 + IN_CAPSULE_DATA_BYTES_MAX) / 16;
/// I/O queue response capsule size in 16-byte units: the CQE alone.
pub const IORCSZ: u32 = 1;
/// Largest data in one H2CData PDU, announced in ICResp.
pub const MAXH2CDATA: u32 = 128 * 1024;
/// Largest data this target puts in one C2HData PDU.
pub const C2H_DATA_PDU_BYTES_MAX: u32 = 128 * 1024;
/// R2Ts this target keeps outstanding per command; every host accepts at least one (MAXR2T is
/// 0's based), so the host's value never needs to be consulted.
pub const R2T_PER_COMMAND_MAX: u32 = 1;
/// The PDU data alignment this target asks of hosts (CPDA, 0's based dwords): none beyond dwords.
pub const CPDA: u8 = 0;
/// Largest PDU the target accepts: an H2CData PDU of MAXH2CDATA bytes with every header, pad
/// and digest.
pub const PDU_SIZE_MAX: u32 = MAXH2CDATA + PDU_HEADER_BYTES_MAX as u32 + DIGEST_BYTES as u32;
/// Outstanding Asynchronous Event Requests per controller (AERL + 1).
pub const AER_OUTSTANDING_MAX: usize = 4;
/// Keep alive granularity reported in KAS, in milliseconds (KAS = 10: 100 ms units).
pub const KEEP_ALIVE_GRANULARITY_MS: u32 = 1000;
/// A connection that has not completed Connect within this time is closed.
pub const CONNECT_DEADLINE_MS: u64 = 30_000;
/// Records in the discovery log page; beyond this, subsystems are left out.
pub const DISCOVERY_RECORDS_MAX: usize = 1024;
/// Default bound on idle buffers kept by one queue's pool.
pub const BUFFER_RETAINED_BYTES_MAX: usize = 16 << 20;
/// The ANA group of every namespace: each subsystem has one namespace, so one group.
pub const ANA_GROUP_ID: u32 = 1;
/// ANA transition time reported in Identify Controller (ANATT), in seconds: how long a host waits
/// for a group in the change state before it gives up on the path.
pub const ANA_TRANSITION_SECONDS: u8 = 10;
/// Subsystem and port pairs whose ANA state differs from optimized, kept by the target.
pub const ANA_ENTRIES_MAX: usize = 65_536;
/// NVMe version reported in VS and Identify Controller: 1.4.0.
pub const VERSION: u32 = crate::command::property::version(1, 4, 0);

const _: () = assert!(IOCCSZ == 516);
const _: () = assert!(TRANSFER_BYTES_MAX == 1 << 20);
const _: () = assert!(MAXH2CDATA <= TRANSFER_BYTES_MAX && MAXH2CDATA % 4 == 0);
const _: () = assert!(MAXH2CDATA >= crate::pdu::MAXH2CDATA_MIN);
// The largest command capsule (header, digest, worst padding, in-capsule data, digest) fits.
const _: () = assert!(
    crate::pdu::CAPSULE_CMD_HEADER_BYTES
        + 2 * DIGEST_BYTES
        + 4 * (CPDA as usize + 1)
        + IN_CAPSULE_DATA_BYTES_MAX as usize
        <= PDU_SIZE_MAX as usize
);
const _: () = assert!(QUEUE_ENTRIES_MAX as usize <= u16::MAX as usize);
const _: () = assert!(IO_QUEUES_MAX <= 64, "I/O queues are tracked in a 64-bit mask");

// The target is shared by every connection's thread; a queue moves to its data-path thread.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    fn movable<T: Send>() {}
    shared::<Target>();
    movable::<Queue>();
    movable::<StorageRequest>();
};

/// Where the target listens, as discovery log entries report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// Transport address: an IPv4 or IPv6 address in text form.
    pub traddr: String,
    /// Transport service ID: the TCP port in decimal.
    pub trsvcid: String,
    /// NVMe port ID reported in discovery log entries.
    pub port_id: u16,
}

/// Target settings, bounded by the module constants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetConfig {
    pub listeners: Vec<Listener>,
    /// Identify Controller MN (40 ASCII characters at most).
    pub model_number: String,
    /// Identify Controller FR (8 ASCII characters at most).
    pub firmware_revision: String,
    /// Serial number of the discovery subsystem's controllers.
    pub discovery_serial_number: String,
    /// I/O queues per controller, at most [`IO_QUEUES_MAX`].
    pub io_queues_max: u16,
    /// Entries per submission queue, 2..=[`QUEUE_ENTRIES_MAX`].
    pub queue_entries_max: u16,
    /// Live controllers on this target, at most the size of `cntlids`.
    pub controllers_max: usize,
    /// The controller IDs this target hands out (within 1..=0xFFEF). Nodes of a cluster that
    /// expose one subsystem each take a disjoint range, because a host refuses two controllers
    /// of one subsystem with the same ID (Linux: "Duplicate cntlid").
    pub cntlids: std::ops::RangeInclusive<u16>,
    /// Idle buffer bytes each queue keeps for reuse.
    pub buffer_retained_bytes_max: usize,
}

impl Default for TargetConfig {
    fn default() -> Self {
        Self {
            listeners: vec![Listener {
                traddr: "127.0.0.1".to_owned(),
                trsvcid: "4420".to_owned(),
                port_id: 1,
            }],
            model_number: "Ferrite".to_owned(),
            firmware_revision: env!("CARGO_PKG_VERSION").to_owned(),
            discovery_serial_number: "ferrite-discovery".to_owned(),
            io_queues_max: IO_QUEUES_MAX,
            queue_entries_max: QUEUE_ENTRIES_MAX,
            controllers_max: 4096,
            cntlids: 1..=CNTLID_MAX,
            buffer_retained_bytes_max: BUFFER_RETAINED_BYTES_MAX,
        }
    }
}

/// The Asymmetric Namespace Access state of a namespace's group as seen through one port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AnaState {
    /// The preferred path: I/O is served.
    #[default]
    Optimized,
    /// I/O is served, but another path is better.
    NonOptimized,
    /// I/O fails with Asymmetric Access Inaccessible (path related, retried elsewhere).
    Inaccessible,
    /// The path is gone for good: I/O fails with Asymmetric Access Persistent Loss.
    PersistentLoss,
    /// The state is changing: I/O fails with Asymmetric Access Transition until it settles.
    Change,
}

impl AnaState {
    /// The STATE value of the ANA log page.
    pub const fn code(self) -> u8 {
        use crate::structures::ana_state;
        match self {
            AnaState::Optimized => ana_state::OPTIMIZED,
            AnaState::NonOptimized => ana_state::NON_OPTIMIZED,
            AnaState::Inaccessible => ana_state::INACCESSIBLE,
            AnaState::PersistentLoss => ana_state::PERSISTENT_LOSS,
            AnaState::Change => ana_state::CHANGE,
        }
    }

    pub const fn from_code(code: u8) -> Option<AnaState> {
        use crate::structures::ana_state;
        Some(match code {
            ana_state::OPTIMIZED => AnaState::Optimized,
            ana_state::NON_OPTIMIZED => AnaState::NonOptimized,
            ana_state::INACCESSIBLE => AnaState::Inaccessible,
            ana_state::PERSISTENT_LOSS => AnaState::PersistentLoss,
            ana_state::CHANGE => AnaState::Change,
            _ => return None,
        })
    }

    /// The status of a command that accesses the namespace in this state, if it must fail.
    pub const fn io_status(self) -> Option<Status> {
        match self {
            AnaState::Optimized | AnaState::NonOptimized => None,
            AnaState::Inaccessible => Some(Status::ANA_INACCESSIBLE),
            AnaState::PersistentLoss => Some(Status::ANA_PERSISTENT_LOSS),
            AnaState::Change => Some(Status::ANA_TRANSITION),
        }
    }
}

/// A subsystem as the discovery log lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubsystemInfo {
    pub nqn: Nqn,
}

/// The one namespace (NSID 1) of a subsystem.
#[derive(Debug, Clone)]
pub struct NamespaceInfo {
    /// The node's handle for the volume behind the namespace; storage requests carry it.
    pub volume: u64,
    /// Size in logical blocks, read on every I/O so that a resize is seen without locks.
    pub size_blocks: Arc<AtomicU64>,
    /// Logical block size: a power of two from 512 to 4096.
    pub block_size_bytes: u32,
    pub nguid: [u8; 16],
    pub uuid: [u8; 16],
    pub eui64: [u8; 8],
    /// The subsystem's serial number (Identify Controller SN), the same for all its controllers.
    pub serial_number: String,
    /// Write protected (a snapshot): Identify Namespace says so (NSATTR bit 0), and Write, Write
    /// Zeroes and Deallocate fail with Namespace Is Write Protected before reaching storage.
    pub read_only: bool,
}

impl NamespaceInfo {
    pub fn size_blocks(&self) -> u64 {
        self.size_blocks.load(Ordering::Relaxed)
    }

    fn block_size_valid(&self) -> bool {
        self.block_size_bytes.is_power_of_two() && (512..=4096).contains(&self.block_size_bytes)
    }
}

/// What the node tells the target about its subsystems. Called on Connect and for discovery,
/// never per I/O.
pub trait Catalog: Send + Sync {
    /// Every NVM subsystem to list in the discovery log (the discovery subsystem is added).
    fn subsystems(&self) -> Vec<SubsystemInfo>;
    /// The namespace of the subsystem `subnqn`, or None if there is no such subsystem.
    fn namespace(&self, subnqn: &Nqn) -> Option<NamespaceInfo>;
    /// Whether `hostnqn` may connect to `subnqn`; every host may by default. A host that may
    /// not is refused at Connect (Connect Invalid Host) and does not see the subsystem in the
    /// discovery log.
    fn host_allowed(&self, _subnqn: &Nqn, _hostnqn: &Nqn) -> bool {
        true
    }
}

/// A controller: the association of one host with one subsystem, shared by its admin queue and
/// its I/O queues, which may live on different threads.
pub(crate) struct Controller {
    pub(crate) cntlid: u16,
    pub(crate) subnqn: Nqn,
    pub(crate) hostnqn: Nqn,
    pub(crate) host_id: [u8; 16],
    /// The NVM subsystem port (listener port ID) the admin queue connected through.
    pub(crate) port_id: u16,
    /// [`AnaState::code`] of the namespace's group through this controller's port.
    pub(crate) ana_state: AtomicU8,
    /// An ANA change notice waits for an Asynchronous Event Request.
    pub(crate) ana_notice_pending: AtomicBool,
    /// None for a discovery controller.
    pub(crate) namespace: Option<NamespaceInfo>,
    pub(crate) cc: AtomicU32,
    pub(crate) csts: AtomicU32,
    /// Bit `qid - 1` is set while I/O queue `qid` is connected.
    io_queues: AtomicU64,
    /// Number of I/O queues granted by Set Features (0's based), or `u32::MAX` before.
    pub(crate) io_queues_granted: AtomicU32,
    /// Set when the admin queue goes away: every I/O queue must close.
    pub(crate) closed: AtomicBool,
    /// The Changed Namespace List log page holds NSID 1.
    pub(crate) namespace_changed: AtomicBool,
    /// A namespace attribute notice waits for an Asynchronous Event Request.
    pub(crate) namespace_notice_pending: AtomicBool,
    /// A discovery log page change notice waits for an Asynchronous Event Request.
    pub(crate) discovery_notice_pending: AtomicBool,
}

impl Controller {
    pub(crate) fn is_discovery(&self) -> bool {
        self.namespace.is_none()
    }

    /// CC.EN = 1 and CSTS.RDY = 1: the controller processes commands other than Fabrics ones.
    pub(crate) fn ready(&self) -> bool {
        use crate::command::property::{CC_ENABLE, CSTS_READY};
        self.cc.load(Ordering::Acquire) & CC_ENABLE != 0
            && self.csts.load(Ordering::Acquire) & CSTS_READY != 0
    }

    pub(crate) fn ana(&self) -> AnaState {
        AnaState::from_code(self.ana_state.load(Ordering::Acquire)).unwrap_or_default()
    }

    pub(crate) fn io_queues_connected(&self) -> bool {
        self.io_queues.load(Ordering::Acquire) != 0
    }

    /// Marks I/O queue `qid` connected; false if it already was.
    pub(crate) fn claim_io_queue(&self, qid: u16) -> bool {
        assert!((1..=IO_QUEUES_MAX).contains(&qid));
        let bit = 1u64 << (qid - 1);
        self.io_queues.fetch_or(bit, Ordering::AcqRel) & bit == 0
    }

    pub(crate) fn release_io_queue(&self, qid: u16) {
        assert!((1..=IO_QUEUES_MAX).contains(&qid));
        self.io_queues.fetch_and(!(1u64 << (qid - 1)), Ordering::AcqRel);
    }
}

/// A refused Connect: the status and the DW0 of its completion.
pub(crate) struct ConnectRefusal {
    pub(crate) status: Status,
    pub(crate) result: u32,
}

struct Registry {
    controllers: HashMap<u16, Arc<Controller>>,
    next_cntlid: u16,
    /// ANA states other than optimized, by subsystem and port.
    ana: HashMap<(Nqn, u16), AnaState>,
}

/// The NVMe/TCP target of one node: catalog, controllers and discovery. Shared by all queues.
pub struct Target {
    config: TargetConfig,
    catalog: Arc<dyn Catalog>,
    registry: Mutex<Registry>,
    discovery_generation: AtomicU64,
    /// CHGCNT of the ANA log page: bumped on every ANA state change.
    ana_change_count: AtomicU64,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("config", &self.config)
            .field("controllers", &self.controller_count())
            .finish()
    }
}

impl Target {
    /// A target serving `catalog`. Panics if `config` is outside the module's limits.
    pub fn new(config: TargetConfig, catalog: Arc<dyn Catalog>) -> Self {
        assert!((1..=IO_QUEUES_MAX).contains(&config.io_queues_max), "io_queues_max out of range");
        assert!(
            (2..=QUEUE_ENTRIES_MAX).contains(&config.queue_entries_max),
            "queue_entries_max out of range"
        );
        assert!(
            *config.cntlids.start() >= 1
                && config.cntlids.start() <= config.cntlids.end()
                && *config.cntlids.end() <= CNTLID_MAX,
            "cntlids out of range"
        );
        let cntlids_count = usize::from(config.cntlids.end() - config.cntlids.start()) + 1;
        let first_cntlid = *config.cntlids.start();
        assert!(
            (1..=cntlids_count).contains(&config.controllers_max),
            "controllers_max out of range"
        );
        Self {
            config,
            catalog,
            registry: Mutex::new(Registry {
                controllers: HashMap::new(),
                next_cntlid: first_cntlid,
                ana: HashMap::new(),
            }),
            discovery_generation: AtomicU64::new(1),
            ana_change_count: AtomicU64::new(1),
        }
    }

    pub fn config(&self) -> &TargetConfig {
        &self.config
    }

    /// Live controllers, discovery controllers included.
    pub fn controller_count(&self) -> usize {
        self.registry().controllers.len()
    }

    /// Tells the hosts connected to `subnqn` that its namespace changed (for example, was
    /// resized): sets the Changed Namespace List log and raises a namespace attribute notice,
    /// which each admin queue delivers on its next `poll` or `receive`.
    pub fn notify_namespace_changed(&self, subnqn: &Nqn) {
        for controller in self.registry().controllers.values() {
            if &controller.subnqn == subnqn {
                controller.namespace_changed.store(true, Ordering::Release);
                controller.namespace_notice_pending.store(true, Ordering::Release);
            }
        }
    }

    /// Tells the target that the set of subsystems changed: bumps the discovery log generation
    /// and raises a discovery log change notice on every discovery controller.
    pub fn notify_subsystems_changed(&self) {
        self.discovery_generation.fetch_add(1, Ordering::AcqRel);
        for controller in self.registry().controllers.values() {
            if controller.is_discovery() {
                controller.discovery_notice_pending.store(true, Ordering::Release);
            }
        }
    }

    /// The port ID of connections accepted by [`Queue::new`]: the first listener's, or 1.
    pub fn default_port_id(&self) -> u16 {
        self.config.listeners.first().map_or(1, |listener| listener.port_id)
    }

    /// Sets the ANA state of `subnqn`'s namespace as seen through port `port_id` (a listener's
    /// port ID). Controllers of that subsystem on that port see it at once: their I/O fails with
    /// the state's path status when it is not optimized or non-optimized, the ANA log page
    /// reports it with a new change count, and each raises an ANA change notice. The state
    /// applies to controllers created later too; it is forgotten with
    /// [`Target::forget_ana_states`].
    pub fn set_ana_state(&self, subnqn: &Nqn, port_id: u16, state: AnaState) {
        let mut registry = self.registry();
        let key = (subnqn.clone(), port_id);
        let previous = registry.ana.get(&key).copied().unwrap_or_default();
        if state == AnaState::Optimized {
            registry.ana.remove(&key);
        } else if registry.ana.len() < ANA_ENTRIES_MAX || registry.ana.contains_key(&key) {
            registry.ana.insert(key, state);
        }
        // Otherwise the table is full: the state is not kept for controllers created later, but
        // the live ones still get it below.
        if previous == state {
            return;
        }
        self.ana_change_count.fetch_add(1, Ordering::AcqRel);
        for controller in registry.controllers.values() {
            if &controller.subnqn == subnqn && controller.port_id == port_id {
                controller.ana_state.store(state.code(), Ordering::Release);
                controller.ana_notice_pending.store(true, Ordering::Release);
            }
        }
    }

    /// The ANA state of `subnqn` through port `port_id` (optimized unless set otherwise).
    pub fn ana_state(&self, subnqn: &Nqn, port_id: u16) -> AnaState {
        self.registry().ana.get(&(subnqn.clone(), port_id)).copied().unwrap_or_default()
    }

    /// Drops the ANA states kept for `subnqn` (for example, its volume was deleted).
    pub fn forget_ana_states(&self, subnqn: &Nqn) {
        self.registry().ana.retain(|(nqn, _), _| nqn != subnqn);
    }

    /// The ANA log change count (CHGCNT).
    pub(crate) fn ana_change_count(&self) -> u64 {
        self.ana_change_count.load(Ordering::Acquire)
    }

    /// Closes the controllers `hostnqn` holds on `subnqn` (for example, the host was removed
    /// from the subsystem's allowed hosts): their queues report `wants_close`. Returns how many.
    pub fn disconnect_host(&self, subnqn: &Nqn, hostnqn: &Nqn) -> usize {
        let mut closed = 0;
        for controller in self.registry().controllers.values() {
            if &controller.subnqn == subnqn && &controller.hostnqn == hostnqn {
                controller.closed.store(true, Ordering::Release);
                closed += 1;
            }
        }
        closed
    }

    /// Closes every controller of `subnqn` (for example, its volume was deleted): their queues
    /// report `wants_close`.
    pub fn disconnect_subsystem(&self, subnqn: &Nqn) {
        for controller in self.registry().controllers.values() {
            if &controller.subnqn == subnqn {
                controller.closed.store(true, Ordering::Release);
            }
        }
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        // A panic while holding the lock cannot leave the map half-updated (each operation is a
        // single insert or remove), so a poisoned lock is still consistent.
        self.registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Creates a controller for an admin queue Connect that arrived on port `port_id`.
    pub(crate) fn create_controller(
        &self,
        data: &ConnectData,
        port_id: u16,
    ) -> Result<Arc<Controller>, ConnectRefusal> {
        let namespace = if data.subnqn.as_str() == types::DISCOVERY_NQN {
            None
        } else {
            let Some(namespace) = self.catalog.namespace(&data.subnqn) else {
                return Err(ConnectRefusal {
                    status: Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
                    result: connect_invalid_parameter_result(true, ConnectData::SUBNQN_OFFSET),
                });
            };
            if !namespace.block_size_valid() {
                return Err(ConnectRefusal { status: Status::INTERNAL_ERROR, result: 0 });
            }
            if !self.catalog.host_allowed(&data.subnqn, &data.hostnqn) {
                return Err(ConnectRefusal {
                    status: Status::CONNECT_INVALID_HOST.with_dnr(),
                    result: connect_invalid_parameter_result(true, ConnectData::HOSTNQN_OFFSET),
                });
            }
            Some(namespace)
        };
        let mut registry = self.registry();
        if registry.controllers.len() >= self.config.controllers_max {
            return Err(ConnectRefusal { status: Status::CONTROLLER_BUSY, result: 0 });
        }
        // Fewer controllers than IDs exist, so a free ID is found within one turn of the range.
        let (first, last) = (*self.config.cntlids.start(), *self.config.cntlids.end());
        let following = |cntlid: u16| if cntlid >= last { first } else { cntlid + 1 };
        let mut cntlid = registry.next_cntlid;
        for _ in first..=last {
            if !registry.controllers.contains_key(&cntlid) {
                break;
            }
            cntlid = following(cntlid);
        }
        assert!(!registry.controllers.contains_key(&cntlid), "no free controller ID");
        registry.next_cntlid = following(cntlid);
        let ana = registry.ana.get(&(data.subnqn.clone(), port_id)).copied().unwrap_or_default();
        let controller = Arc::new(Controller {
            cntlid,
            subnqn: data.subnqn.clone(),
            hostnqn: data.hostnqn.clone(),
            host_id: data.host_id,
            port_id,
            ana_state: AtomicU8::new(ana.code()),
            ana_notice_pending: AtomicBool::new(false),
            namespace,
            cc: AtomicU32::new(0),
            csts: AtomicU32::new(0),
            io_queues: AtomicU64::new(0),
            io_queues_granted: AtomicU32::new(u32::MAX),
            closed: AtomicBool::new(false),
            namespace_changed: AtomicBool::new(false),
            namespace_notice_pending: AtomicBool::new(false),
            discovery_notice_pending: AtomicBool::new(false),
        });
        registry.controllers.insert(cntlid, Arc::clone(&controller));
        Ok(controller)
    }

    pub(crate) fn find_controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        self.registry().controllers.get(&cntlid).cloned()
    }

    /// Removes a controller when its admin queue goes away and closes its I/O queues.
    pub(crate) fn remove_controller(&self, controller: &Controller) {
        controller.closed.store(true, Ordering::Release);
        let mut registry = self.registry();
        if let Some(found) = registry.controllers.get(&controller.cntlid) {
            if std::ptr::eq(Arc::as_ptr(found), controller) {
                registry.controllers.remove(&controller.cntlid);
            }
        }
    }

    /// Appends the whole discovery log page as `hostnqn` may see it: the header, then for each
    /// listener one entry for the discovery subsystem itself and one per subsystem the host is
    /// allowed to connect to.
    pub(crate) fn encode_discovery_log(&self, out: &mut Vec<u8>, hostnqn: &Nqn) {
        let mut subsystems = self.catalog.subsystems();
        subsystems.retain(|subsystem| self.catalog.host_allowed(&subsystem.nqn, hostnqn));
        subsystems.sort_by(|a, b| a.nqn.cmp(&b.nqn));
        let discovery = Nqn::discovery();
        let mut entries = Vec::new();
        for listener in &self.config.listeners {
            let current = std::iter::once((&discovery, subtype::CURRENT_DISCOVERY));
            let nvm = subsystems.iter().map(|subsystem| (&subsystem.nqn, subtype::NVM));
            for (nqn, entry_subtype) in current.chain(nvm) {
                if entries.len() == DISCOVERY_RECORDS_MAX {
                    break;
                }
                entries.push(DiscoveryLogEntry {
                    trtype: trtype::TCP,
                    adrfam: if listener.traddr.contains(':') { adrfam::IPV6 } else { adrfam::IPV4 },
                    subtype: entry_subtype,
                    treq: treq::NOT_REQUIRED,
                    port_id: listener.port_id,
                    cntlid: crate::command::CNTLID_DYNAMIC,
                    asqsz: self.config.queue_entries_max,
                    eflags: 0,
                    trsvcid: listener.trsvcid.clone(),
                    subnqn: nqn.as_str().to_owned(),
                    traddr: listener.traddr.clone(),
                    sectype: 0,
                });
            }
        }
        let header = DiscoveryLogHeader {
            generation: self.discovery_generation.load(Ordering::Acquire),
            record_count: entries.len() as u64,
            record_format: 0,
        };
        let start = out.len();
        out.resize(start + DISCOVERY_LOG_RECORD_BYTES * (1 + entries.len()), 0);
        let records = &mut out[start..];
        header.encode(&mut records[..DISCOVERY_LOG_RECORD_BYTES]);
        for (index, entry) in entries.iter().enumerate() {
            let at = DISCOVERY_LOG_RECORD_BYTES * (index + 1);
            entry.encode(&mut records[at..at + DISCOVERY_LOG_RECORD_BYTES]);
        }
    }
}
