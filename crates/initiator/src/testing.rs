//! A test fixture: `nvmf`'s real NVMe/TCP target, served over tokio TCP listeners on
//! 127.0.0.1 with a RAM disk behind it, for the tests of this crate and of the crates built on it
//! (`bench`). It is not a mock: every connection runs [`nvmf::target::Queue`], the same state
//! machine a Ferrite node runs, and only the storage under it (a `Vec<u8>`) and the socket driver
//! are the fixture's own. It is compiled only with the `testing` feature.
//!
//! The hooks let a test break things on purpose: drop a connection in the middle of a Read
//! ([`RamTarget::close_on_read`]), cut every connection of one port ([`RamTarget::set_port_cut`]),
//! make one port stop answering as a stopped process does ([`RamTarget::set_port_stalled`]),
//! change a port's ANA state ([`RamTarget::set_ana_state`], which raises ANA change notices),
//! resize the namespace ([`RamTarget::resize_namespace`], which raises namespace attribute
//! notices), reach the target itself ([`RamTarget::target`]), and count what was served
//! ([`RamTarget::reads_on_port`], [`RamTarget::connections_on_port`],
//! [`RamTarget::keep_alive_expired`]).

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nvmf::target::{
    AnaState, Catalog, Listener, NamespaceInfo, Queue, StorageOperation, StorageStatus,
    SubsystemInfo, Target, TargetConfig,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use crate::{AlignedBuf, Nqn};

/// Listeners (ports) one fixture opens at most.
pub const RAM_TARGET_PORTS_MAX: u16 = 8;
/// The RAM disk is at most this large, so that a wrong option fails fast instead of exhausting
/// memory.
pub const RAM_TARGET_DISK_BYTES_MAX: u64 = 1 << 30;
/// Bytes a connection's receive buffer holds beyond the largest PDU, so that several small PDUs
/// are taken in one read.
const RECEIVE_SLACK_BYTES: usize = 64 * 1024;
/// A Read of this LBA never closes the connection (no LBA is this large).
const NO_CLOSE_LBA: u64 = u64::MAX;

/// How to build a [`RamTarget`].
#[derive(Debug, Clone)]
pub struct RamTargetOptions {
    /// The one NVM subsystem served; its namespace is NSID 1.
    pub subnqn: Nqn,
    /// How many listeners, each a port of the subsystem with port IDs 1, 2, … in order.
    pub ports: u16,
    /// Namespace size in logical blocks.
    pub size_blocks: u64,
    /// Logical block size: a power of two from 512 to 4096.
    pub block_size_bytes: u32,
    /// Identify Controller SN of the subsystem.
    pub serial_number: String,
    /// A connection looks at its port's cut switch, its keep-alive and the target's timers at
    /// least this often.
    pub tick: Duration,
}

impl Default for RamTargetOptions {
    fn default() -> Self {
        RamTargetOptions {
            subnqn: Nqn::new("nqn.2024-01.io.ferrite:vol:ram-target")
                .expect("a constant, valid NQN"),
            ports: 1,
            size_blocks: 4096,
            block_size_bytes: 4096,
            serial_number: "ram-target".to_owned(),
            tick: Duration::from_millis(100),
        }
    }
}

/// The subsystem list and namespace the target asks about on Connect and for discovery.
struct RamCatalog {
    subnqn: Nqn,
    namespace: NamespaceInfo,
}

impl Catalog for RamCatalog {
    fn subsystems(&self) -> Vec<SubsystemInfo> {
        vec![SubsystemInfo { nqn: self.subnqn.clone() }]
    }

    fn namespace(&self, subnqn: &Nqn) -> Option<NamespaceInfo> {
        (*subnqn == self.subnqn).then(|| self.namespace.clone())
    }
}

/// What the connection drivers share with the test.
struct Shared {
    disk: Mutex<Vec<u8>>,
    block_size_bytes: usize,
    tick: Duration,
    started: Instant,
    /// A Read of this LBA makes the driver drop the connection without answering.
    close_on_read_lba: AtomicU64,
    /// Set when a connection closed because its keep-alive expired.
    keep_alive_expired: AtomicBool,
    /// Per port (index `port_id - 1`): connections drop at their next tick while set.
    port_cut: Vec<AtomicBool>,
    /// Per port (index `port_id - 1`): connections neither read, run nor answer anything while
    /// set, as if the node were stopped (SIGSTOP); new connections are accepted and stall too.
    port_stalled: Vec<AtomicBool>,
    /// Per port (index `port_id - 1`): Read commands served.
    reads: Vec<AtomicU64>,
    /// Per port (index `port_id - 1`): TCP connections accepted.
    accepted: Vec<AtomicU64>,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn disk(&self) -> MutexGuard<'_, Vec<u8>> {
        // A poisoned lock means another test thread panicked; that panic is the failure to see.
        self.disk.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn port_index(port_id: u16) -> usize {
        assert!(port_id >= 1, "port IDs start at 1");
        usize::from(port_id - 1)
    }
}

/// `nvmf`'s target on 127.0.0.1 with a RAM disk: see the module documentation. Dropping it stops
/// its listeners and every connection they accepted.
pub struct RamTarget {
    addresses: Vec<SocketAddr>,
    subnqn: Nqn,
    target: Arc<Target>,
    shared: Arc<Shared>,
    /// The namespace size the target reports, shared with its catalog.
    size_blocks: Arc<AtomicU64>,
    accept_tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RamTarget {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("RamTarget")
            .field("addresses", &self.addresses)
            .field("subnqn", &self.subnqn)
            .finish_non_exhaustive()
    }
}

impl Drop for RamTarget {
    fn drop(&mut self) {
        for task in &self.accept_tasks {
            task.abort();
        }
    }
}

impl RamTarget {
    /// Binds `options.ports` listeners on 127.0.0.1 (free ports) and serves them.
    ///
    /// # Panics
    /// On options out of range, or when no local port can be bound: a test fixture that cannot
    /// start has nothing to test.
    pub async fn start(options: RamTargetOptions) -> RamTarget {
        assert!(
            (1..=RAM_TARGET_PORTS_MAX).contains(&options.ports),
            "1 to {RAM_TARGET_PORTS_MAX} ports"
        );
        assert!(
            options.block_size_bytes.is_power_of_two()
                && (512..=4096).contains(&options.block_size_bytes),
            "block size {} is not a power of two from 512 to 4096",
            options.block_size_bytes
        );
        let disk_bytes = options.size_blocks * u64::from(options.block_size_bytes);
        assert!(disk_bytes <= RAM_TARGET_DISK_BYTES_MAX, "a RAM disk of {disk_bytes} bytes");
        assert!(!options.tick.is_zero(), "a tick of zero would spin");

        let mut listeners = Vec::with_capacity(usize::from(options.ports));
        for _ in 0..options.ports {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
            listeners.push(listener);
        }
        let addresses: Vec<SocketAddr> = listeners
            .iter()
            .map(|listener| listener.local_addr().expect("a bound listener has an address"))
            .collect();
        let config = TargetConfig {
            listeners: addresses
                .iter()
                .zip(1u16..)
                .map(|(address, port_id)| Listener {
                    traddr: address.ip().to_string(),
                    trsvcid: address.port().to_string(),
                    port_id,
                })
                .collect(),
            ..TargetConfig::default()
        };
        let size_blocks = Arc::new(AtomicU64::new(options.size_blocks));
        let namespace = NamespaceInfo {
            volume: 1,
            size_blocks: Arc::clone(&size_blocks),
            block_size_bytes: options.block_size_bytes,
            nguid: [1; 16],
            uuid: [2; 16],
            eui64: [3; 8],
            serial_number: options.serial_number,
            read_only: false,
        };
        let catalog = RamCatalog { subnqn: options.subnqn.clone(), namespace };
        let target = Arc::new(Target::new(config, Arc::new(catalog)));
        let shared = Arc::new(Shared {
            disk: Mutex::new(vec![0; disk_bytes as usize]),
            block_size_bytes: options.block_size_bytes as usize,
            tick: options.tick,
            started: Instant::now(),
            close_on_read_lba: AtomicU64::new(NO_CLOSE_LBA),
            keep_alive_expired: AtomicBool::new(false),
            port_cut: (0..options.ports).map(|_| AtomicBool::new(false)).collect(),
            port_stalled: (0..options.ports).map(|_| AtomicBool::new(false)).collect(),
            reads: (0..options.ports).map(|_| AtomicU64::new(0)).collect(),
            accepted: (0..options.ports).map(|_| AtomicU64::new(0)).collect(),
        });
        let accept_tasks = listeners
            .into_iter()
            .zip(1u16..)
            .map(|(listener, port_id)| {
                tokio::spawn(accept(listener, port_id, Arc::clone(&target), Arc::clone(&shared)))
            })
            .collect();
        RamTarget { addresses, subnqn: options.subnqn, target, shared, size_blocks, accept_tasks }
    }

    /// The first port's address.
    pub fn address(&self) -> SocketAddr {
        self.addresses[0]
    }

    /// Every port's address, in port ID order, as `host:port` strings.
    pub fn addresses(&self) -> Vec<String> {
        self.addresses.iter().map(SocketAddr::to_string).collect()
    }

    /// The subsystem served.
    pub fn subnqn(&self) -> &Nqn {
        &self.subnqn
    }

    /// The target itself, for what a node would do to it (ANA states, namespace changes).
    pub fn target(&self) -> &Arc<Target> {
        &self.target
    }

    /// The RAM disk, `size_blocks * block_size_bytes` bytes. Hold the guard briefly: every
    /// connection waits on it.
    pub fn disk(&self) -> MutexGuard<'_, Vec<u8>> {
        self.shared.disk()
    }

    /// From now on a Read of `lba` drops its connection without an answer.
    pub fn close_on_read(&self, lba: u64) {
        self.shared.close_on_read_lba.store(lba, Ordering::SeqCst);
    }

    /// Whether a connection has closed because its keep-alive expired.
    pub fn keep_alive_expired(&self) -> bool {
        self.shared.keep_alive_expired.load(Ordering::SeqCst)
    }

    /// While `cut`, every connection of port `port_id` drops at its next tick (new ones are
    /// accepted and dropped the same way).
    pub fn set_port_cut(&self, port_id: u16, cut: bool) {
        self.shared.port_cut[Shared::port_index(port_id)].store(cut, Ordering::SeqCst);
    }

    /// While `stalled`, every connection of port `port_id` stops reading, serving and answering
    /// (its keep-alive clock stops too), as a stopped node's would; what the host sends meanwhile
    /// waits in the socket and is served once the stall ends, unless the connection was reset.
    pub fn set_port_stalled(&self, port_id: u16, stalled: bool) {
        self.shared.port_stalled[Shared::port_index(port_id)].store(stalled, Ordering::SeqCst);
    }

    /// Sets the ANA state of the subsystem through port `port_id`, as a node does: I/O through
    /// that port fails with the state's path status, and every controller on it gets an ANA
    /// change notice.
    pub fn set_ana_state(&self, port_id: u16, state: AnaState) {
        assert!(
            (1..=self.addresses.len()).contains(&usize::from(port_id)),
            "port {port_id} of {}",
            self.addresses.len()
        );
        self.target.set_ana_state(&self.subnqn, port_id, state);
    }

    /// Resizes the namespace to `size_blocks` (grown blocks read as zeros) and tells every
    /// connected host with a namespace attribute notice, as a node does when a volume is resized.
    ///
    /// # Panics
    /// When the new size is zero or over [`RAM_TARGET_DISK_BYTES_MAX`].
    pub fn resize_namespace(&self, size_blocks: u64) {
        let disk_bytes = size_blocks * self.shared.block_size_bytes as u64;
        assert!(
            size_blocks > 0 && disk_bytes <= RAM_TARGET_DISK_BYTES_MAX,
            "a RAM disk of {size_blocks} blocks"
        );
        // Under the disk lock, so no storage request sees the new size with the old disk.
        let mut disk = self.shared.disk();
        disk.resize(disk_bytes as usize, 0);
        self.size_blocks.store(size_blocks, Ordering::SeqCst);
        drop(disk);
        self.target.notify_namespace_changed(&self.subnqn);
    }

    /// The namespace size the target reports now.
    pub fn size_blocks(&self) -> u64 {
        self.size_blocks.load(Ordering::SeqCst)
    }

    /// TCP connections accepted on port `port_id` (each controller's admin queue and each I/O
    /// queue is one).
    pub fn connections_on_port(&self, port_id: u16) -> u64 {
        self.shared.accepted[Shared::port_index(port_id)].load(Ordering::SeqCst)
    }

    /// Read commands served through port `port_id`.
    pub fn reads_on_port(&self, port_id: u16) -> u64 {
        self.shared.reads[Shared::port_index(port_id)].load(Ordering::SeqCst)
    }
}

/// Accepts connections on one port until the fixture is dropped; dropping this task's `JoinSet`
/// aborts the connections it started.
async fn accept(listener: TcpListener, port_id: u16, target: Arc<Target>, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let Ok((stream, peer)) = listener.accept().await else { return };
        shared.accepted[Shared::port_index(port_id)].fetch_add(1, Ordering::SeqCst);
        let queue =
            Queue::new_on_port(Arc::clone(&target), peer.to_string(), port_id, shared.now_ms());
        connections.spawn(serve(queue, port_id, stream, Arc::clone(&shared)));
    }
}

/// The driver of one connection: feeds received bytes to the queue, runs its storage requests
/// against the RAM disk, sends its output. Closes when the queue wants to, when its port is cut,
/// or when a hook says so.
async fn serve(mut queue: Queue, port_id: u16, mut stream: TcpStream, shared: Arc<Shared>) {
    if stream.set_nodelay(true).is_err() {
        return;
    }
    let port_index = Shared::port_index(port_id);
    let mut buffer = vec![0u8; Queue::pdu_size_max() + RECEIVE_SLACK_BYTES];
    let mut filled = 0;
    loop {
        if shared.port_cut[port_index].load(Ordering::SeqCst) {
            return;
        }
        if shared.port_stalled[port_index].load(Ordering::SeqCst) {
            tokio::time::sleep(shared.tick).await;
            continue;
        }
        while let Some(request) = queue.next_request() {
            let Some((result, buf)) = execute(&shared, port_index, request.operation) else {
                return; // Drop the connection mid-command.
            };
            queue.complete(request.id, result, buf);
        }
        let length = queue.output_len();
        if length > 0 {
            for chunk in queue.output_chunks() {
                if stream.write_all(chunk).await.is_err() {
                    return;
                }
            }
            queue.consume_output(length);
        }
        if queue.wants_close() {
            return;
        }
        if queue.keep_alive_expired(shared.now_ms()) {
            shared.keep_alive_expired.store(true, Ordering::SeqCst);
            return;
        }
        let read = match tokio::time::timeout(shared.tick, stream.read(&mut buffer[filled..])).await
        {
            Err(_) => {
                queue.poll(shared.now_ms());
                continue;
            }
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(read)) => read,
        };
        filled += read;
        match queue.receive(&buffer[..filled], shared.now_ms()) {
            Ok(consumed) => {
                buffer.copy_within(consumed..filled, 0);
                filled -= consumed;
            }
            Err(_) => {
                for chunk in queue.output_chunks() {
                    if stream.write_all(chunk).await.is_err() {
                        break;
                    }
                }
                return;
            }
        }
    }
}

/// What one storage operation completes with: its result and the buffer it gives back.
type Outcome = (Result<(), StorageStatus>, Option<AlignedBuf>);

/// Runs one storage operation on the RAM disk; `None` asks the driver to drop the connection.
/// The target has checked every range against the namespace size before it asks; a range the
/// disk no longer holds (it shrank since) fails with LBA Out of Range.
fn execute(shared: &Shared, port_index: usize, operation: StorageOperation) -> Option<Outcome> {
    let block_bytes = shared.block_size_bytes;
    let range = |lba: u64, blocks: u32| -> Range<usize> {
        lba as usize * block_bytes..(lba as usize + blocks as usize) * block_bytes
    };
    let mut disk = shared.disk();
    let beyond = match &operation {
        StorageOperation::Read { lba, blocks, .. }
        | StorageOperation::Write { lba, blocks, .. }
        | StorageOperation::WriteZeroes { lba, blocks } => range(*lba, *blocks).end > disk.len(),
        StorageOperation::Deallocate { ranges } => {
            ranges.iter().any(|(lba, blocks)| range(lba, blocks).end > disk.len())
        }
        StorageOperation::Flush => false,
    };
    if beyond {
        let buffer = match operation {
            StorageOperation::Read { buf, .. } | StorageOperation::Write { buf, .. } => Some(buf),
            StorageOperation::Deallocate { ranges } => Some(ranges.into_buf()),
            StorageOperation::Flush | StorageOperation::WriteZeroes { .. } => None,
        };
        return Some((Err(StorageStatus::LbaOutOfRange), buffer));
    }
    Some(match operation {
        StorageOperation::Read { lba, blocks, mut buf } => {
            if lba == shared.close_on_read_lba.load(Ordering::SeqCst) {
                return None;
            }
            shared.reads[port_index].fetch_add(1, Ordering::SeqCst);
            let bytes = range(lba, blocks);
            let length = bytes.len();
            buf[..length].copy_from_slice(&disk[bytes]);
            (Ok(()), Some(buf))
        }
        StorageOperation::Write { lba, blocks, buf } => {
            let bytes = range(lba, blocks);
            let length = bytes.len();
            disk[bytes].copy_from_slice(&buf[..length]);
            (Ok(()), Some(buf))
        }
        StorageOperation::Flush => (Ok(()), None),
        StorageOperation::WriteZeroes { lba, blocks } => {
            disk[range(lba, blocks)].fill(0);
            (Ok(()), None)
        }
        StorageOperation::Deallocate { ranges } => {
            for (lba, blocks) in ranges.iter() {
                disk[range(lba, blocks)].fill(0);
            }
            (Ok(()), Some(ranges.into_buf()))
        }
    })
}
