//! Native NVMe multipath for one namespace, done the way the Linux host does it: connect a
//! controller on every path (port) of the subsystem, learn each path's Asymmetric Namespace
//! Access state from the ANA log page, send I/O down the current path while it stays optimized,
//! else the first optimized path, else the first non-optimized one (`nvme_find_path`); paths in
//! the inaccessible, persistent loss or change states, and paths whose controller is gone, get
//! no I/O. On a path error (a path related status such as ANA Inaccessible, or a broken
//! connection) the host rereads the ANA states and retries the command on the path chosen then.
//! Command errors that are not about the path (LBA out of range, ...) are returned as they are,
//! as Linux does.
//!
//! Each path's state is read live from its [`Controller`], whose asynchronous event task rereads
//! the ANA log page on every ANA change notice: a path changes state, and I/O moves, without any
//! I/O failing first. Path errors and [`MultipathNamespace::refresh`] reread the log too. Each
//! retry copies the command's data again (a write's data is kept by the caller's slice), so this
//! is for tests and tools, not a hot path.
//!
//! Failover, as Linux rides through it (`nvme_core.io_timeout`, `ctrl_loss_tmo`,
//! `reconnect_delay`): a command that does not complete within the I/O timeout is a path error.
//! The path's controller is dropped, its I/O connection closed with a TCP reset (so a command
//! the host still held unsent is never delivered to a node that wakes up later), the path is
//! down, and the command is retried elsewhere. A down path is reconnected in the background, at
//! most once per [`MULTIPATH_RECONNECT_INTERVAL`], so a node that comes back serves again as soon
//! as its ANA state allows. While no path is usable (the old primary gone, the new one not yet
//! optimized) a command waits and looks again for up to the failover timeout before it fails.
//!
//! What the host cannot do: a command that had already reached a stalled node's socket before
//! the reset stays in that node's receive buffer and runs if the node resumes. Fencing stale
//! primaries is the target side's job (replication epochs and leases).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use nvmf::target::AnaState;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use types::{AlignedBuf, Nqn};

use crate::controller::{ConnectOptions, Controller};
use crate::error::InitiatorError;
use crate::io_queue::IoQueue;

/// Paths (controllers) of one multipath namespace at most.
pub const MULTIPATH_PATHS_MAX: usize = 16;
/// Attempts of one I/O on paths that then failed it (path status, broken connection, timeout)
/// before its last error is returned; waiting while no path is usable is bounded by the
/// failover timeout instead.
pub const MULTIPATH_ATTEMPTS_MAX: usize = 2 * MULTIPATH_PATHS_MAX;
/// Pause before looking again when no path is usable (every path inaccessible, changing or
/// down), so a transition in progress can finish; also before retrying on a path that just
/// failed a command and still reports itself usable.
pub const MULTIPATH_RETRY_DELAY: Duration = Duration::from_millis(50);
/// Time a command may take on a path before the path is given up (Linux's
/// `nvme_core.io_timeout` default).
pub const MULTIPATH_IO_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Time a command keeps looking for a usable path, from its first path error or the first time
/// it found none, before it fails.
pub const MULTIPATH_FAILOVER_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Largest I/O or failover timeout accepted: beyond it a host is hung, not riding through.
pub const MULTIPATH_TIMEOUT_MAX: Duration = Duration::from_secs(3600);
/// A down path gets a reconnection attempt at most this often.
pub const MULTIPATH_RECONNECT_INTERVAL: Duration = Duration::from_millis(500);

const _: () = assert!(MULTIPATH_RETRY_DELAY.as_millis() > 0);
const _: () = assert!(MULTIPATH_IO_TIMEOUT_DEFAULT.as_secs() <= MULTIPATH_TIMEOUT_MAX.as_secs());
const _: () =
    assert!(MULTIPATH_FAILOVER_TIMEOUT_DEFAULT.as_secs() <= MULTIPATH_TIMEOUT_MAX.as_secs());

/// What the host knows of one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    /// ANA optimized (also a controller that reports no ANA): preferred.
    Optimized,
    /// ANA non-optimized: used when no optimized path is left.
    NonOptimized,
    /// ANA inaccessible, persistent loss or change: not used until it changes.
    Inaccessible,
    /// The connection broke, timed out or never came up; reconnected in the background.
    Down,
}

impl PathState {
    fn from_ana(state: AnaState) -> PathState {
        match state {
            AnaState::Optimized => PathState::Optimized,
            AnaState::NonOptimized => PathState::NonOptimized,
            AnaState::Inaccessible | AnaState::PersistentLoss | AnaState::Change => {
                PathState::Inaccessible
            }
        }
    }
}

/// One path as [`MultipathNamespace::paths`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathInfo {
    pub address: String,
    /// The controller ID on this path, when connected.
    pub cntlid: Option<u16>,
    pub state: PathState,
}

/// A controller with the namespace's one I/O queue on it.
type Connection = (Controller, IoQueue);

/// A reconnection running in its own task; aborted when dropped (the path is dropped, or the
/// attempt's result is no longer wanted).
struct Reconnect {
    task: AbortHandle,
    result: oneshot::Receiver<Result<Connection, InitiatorError>>,
}

impl Drop for Reconnect {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Path {
    address: String,
    /// The controller and its one I/O queue; None when down.
    connection: Option<Connection>,
    /// A background reconnection in progress, while down.
    reconnect: Option<Reconnect>,
    /// When the last reconnection started, for [`MULTIPATH_RECONNECT_INTERVAL`].
    reconnect_started: Option<Instant>,
}

impl Path {
    /// Down without a live controller, else what its last ANA log page read says of `nsid`.
    fn state(&self, nsid: u32) -> PathState {
        match &self.connection {
            Some((controller, _)) if controller.is_live() => {
                PathState::from_ana(controller.ana_state(nsid))
            }
            _ => PathState::Down,
        }
    }
}

/// How one attempt of a command on a path ended, when it did not succeed.
enum AttemptError {
    /// Not about the path: returned to the caller as it is.
    Command(InitiatorError),
    /// A path related status: the path stays up, its ANA state is read again.
    PathStatus(InitiatorError),
    /// The connection broke or the command timed out: the path is down.
    PathLost(InitiatorError),
}

/// One command, issued again on each path tried: its data is copied anew each time.
type Command<'c, T> = dyn for<'q> FnMut(&'q mut IoQueue) -> CommandFuture<'q, T> + Send + 'c;
/// One issue of a [`Command`] on one queue.
type CommandFuture<'q, T> = Pin<Box<dyn Future<Output = Result<T, InitiatorError>> + Send + 'q>>;

/// One namespace reached through several paths. See the module documentation.
pub struct MultipathNamespace {
    subnqn: Nqn,
    nsid: u32,
    lba_size_bytes: u32,
    size_blocks: u64,
    queue_depth: u16,
    options: ConnectOptions,
    paths: Vec<Path>,
    /// The path I/O goes to while it stays usable (Linux's current path).
    current: Option<usize>,
    /// Commands that failed on a path and were tried again.
    failovers: u64,
    /// A command that has not completed on its path within this is a path error.
    io_timeout: Duration,
    /// How long a command keeps looking for a usable path before it fails.
    failover_timeout: Duration,
    /// The path a command is running on; still set when the caller dropped the command's
    /// future half-way, which leaves that path's queue in an unknown state.
    in_flight: Option<usize>,
}

impl std::fmt::Debug for MultipathNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultipathNamespace")
            .field("subnqn", &self.subnqn)
            .field("nsid", &self.nsid)
            .field("paths", &self.paths())
            .field("current", &self.current)
            .field("io_timeout", &self.io_timeout)
            .field("failover_timeout", &self.failover_timeout)
            .finish()
    }
}

/// Connects a controller at `address` and opens one I/O queue on its namespace: one path, not
/// yet checked against the others.
async fn open_path(
    address: String,
    subnqn: Nqn,
    options: ConnectOptions,
    queue_depth: u16,
) -> Result<Connection, InitiatorError> {
    let controller = Controller::connect(address.as_str(), &subnqn, options).await?;
    let queue = controller.open_io_queue(queue_depth).await?;
    Ok((controller, queue))
}

impl MultipathNamespace {
    /// Connects a controller and one I/O queue of `queue_depth` on every address (each a port of
    /// the subsystem `subnqn`), reads each path's ANA state and picks the current path. Succeeds
    /// when at least one path connects; the others are kept as down and reconnected in the
    /// background (and by [`MultipathNamespace::refresh`]). The I/O and failover timeouts start
    /// at [`MULTIPATH_IO_TIMEOUT_DEFAULT`] and [`MULTIPATH_FAILOVER_TIMEOUT_DEFAULT`].
    pub async fn connect(
        addresses: &[String],
        subnqn: &Nqn,
        options: ConnectOptions,
        queue_depth: u16,
    ) -> Result<MultipathNamespace, InitiatorError> {
        if addresses.is_empty() || addresses.len() > MULTIPATH_PATHS_MAX {
            return Err(InitiatorError::InvalidRequest(format!(
                "multipath needs 1 to {MULTIPATH_PATHS_MAX} addresses, got {}",
                addresses.len()
            )));
        }
        let mut device = MultipathNamespace {
            subnqn: subnqn.clone(),
            nsid: 0,
            lba_size_bytes: 0,
            size_blocks: 0,
            queue_depth,
            options,
            paths: addresses
                .iter()
                .map(|address| Path {
                    address: address.clone(),
                    connection: None,
                    reconnect: None,
                    reconnect_started: None,
                })
                .collect(),
            current: None,
            failovers: 0,
            io_timeout: MULTIPATH_IO_TIMEOUT_DEFAULT,
            failover_timeout: MULTIPATH_FAILOVER_TIMEOUT_DEFAULT,
            in_flight: None,
        };
        let mut last_error = None;
        for index in 0..device.paths.len() {
            if let Err(error) = device.connect_path(index).await {
                tracing::debug!(address = %device.paths[index].address, %error, "path down");
                last_error = Some(error);
            }
        }
        if device.paths.iter().all(|path| path.connection.is_none()) {
            return Err(last_error.expect("every path failed with an error"));
        }
        for path in &mut device.paths {
            if path.connection.is_none() {
                path.reconnect_started = Some(Instant::now());
            }
        }
        device.select_path();
        Ok(device)
    }

    /// The time a command may take on one path before the path is given up.
    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Sets the I/O timeout (above zero, at most [`MULTIPATH_TIMEOUT_MAX`]). A command that does
    /// not complete within it on its path makes the path down (its controller dropped, its I/O
    /// connection reset) and is retried on another path. ANA log reads during failover and
    /// background reconnections are bounded by it too.
    pub fn set_io_timeout(&mut self, timeout: Duration) {
        assert!(
            !timeout.is_zero() && timeout <= MULTIPATH_TIMEOUT_MAX,
            "an I/O timeout of {timeout:?}"
        );
        self.io_timeout = timeout;
    }

    /// How long a command keeps looking for a usable path before it fails.
    pub fn failover_timeout(&self) -> Duration {
        self.failover_timeout
    }

    /// Sets the failover timeout (at most [`MULTIPATH_TIMEOUT_MAX`]; zero fails at once when
    /// no path is usable). It counts from a command's first path error, or from the first time
    /// it found no usable path; meanwhile the command looks again every
    /// [`MULTIPATH_RETRY_DELAY`].
    pub fn set_failover_timeout(&mut self, timeout: Duration) {
        assert!(timeout <= MULTIPATH_TIMEOUT_MAX, "a failover timeout of {timeout:?}");
        self.failover_timeout = timeout;
    }

    /// The longest one connection attempt (controller bring-up and I/O queue) may take.
    fn connect_timeout(&self) -> Duration {
        self.options.connect_timeout.saturating_add(self.io_timeout)
    }

    /// Connects path `index` now (the controller reads its ANA state as it connects) and checks
    /// it reaches the same namespace as the others.
    async fn connect_path(&mut self, index: usize) -> Result<(), InitiatorError> {
        let address = self.paths[index].address.clone();
        let attempt =
            open_path(address, self.subnqn.clone(), self.options.clone(), self.queue_depth);
        let connection = match tokio::time::timeout(self.connect_timeout(), attempt).await {
            Ok(result) => result?,
            Err(_) => return Err(self.connect_timed_out(index)),
        };
        self.adopt(index, connection)
    }

    fn connect_timed_out(&self, index: usize) -> InitiatorError {
        InitiatorError::PathConnectTimeout {
            address: self.paths[index].address.clone(),
            subnqn: self.subnqn.clone(),
            timeout_ms: u64::try_from(self.connect_timeout().as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// Makes a freshly connected controller path `index`'s, if it shows the same namespace as
    /// the others and a controller ID no other path has.
    fn adopt(&mut self, index: usize, connection: Connection) -> Result<(), InitiatorError> {
        let (controller, _) = &connection;
        let address = &self.paths[index].address;
        let namespace = *controller
            .namespace()
            .ok_or_else(|| InitiatorError::NoNamespace { subnqn: self.subnqn.clone() })?;
        if self.nsid == 0 {
            self.nsid = namespace.nsid;
            self.lba_size_bytes = namespace.lba_size_bytes;
            self.size_blocks = namespace.size_blocks;
        } else if namespace.nsid != self.nsid || namespace.lba_size_bytes != self.lba_size_bytes {
            return Err(InitiatorError::Namespace {
                subnqn: self.subnqn.clone(),
                nsid: namespace.nsid,
                problem: format!("path {address} shows a different namespace than the others"),
            });
        }
        let others = self.paths.iter().filter_map(|path| path.connection.as_ref());
        if others.map(|(other, _)| other.cntlid()).any(|cntlid| cntlid == controller.cntlid()) {
            return Err(InitiatorError::Namespace {
                subnqn: self.subnqn.clone(),
                nsid: namespace.nsid,
                problem: format!("path {address} repeats a controller ID of another path"),
            });
        }
        let path = &mut self.paths[index];
        path.connection = Some(connection);
        path.reconnect = None;
        Ok(())
    }

    /// Linux's path choice from `current`: keep it while it is optimized; else the first
    /// optimized path, else the first non-optimized one.
    fn choose(&self, current: Option<usize>) -> Option<usize> {
        let states: Vec<PathState> = self.paths.iter().map(|path| path.state(self.nsid)).collect();
        if let Some(current) = current {
            if states[current] == PathState::Optimized {
                return Some(current);
            }
        }
        let first = |wanted: PathState| states.iter().position(|state| *state == wanted);
        first(PathState::Optimized).or_else(|| first(PathState::NonOptimized))
    }

    fn select_path(&mut self) {
        self.current = self.choose(self.current);
    }

    /// Drops controllers whose connection ended, takes in finished background reconnections and
    /// starts new ones on down paths whose last attempt is [`MULTIPATH_RECONNECT_INTERVAL`] old.
    /// Never waits.
    fn maintain_paths(&mut self) {
        let now = Instant::now();
        for index in 0..self.paths.len() {
            if self.paths[index].connection.as_ref().is_some_and(|(c, _)| !c.is_live()) {
                self.mark_down(index);
            }
            if self.paths[index].connection.is_some() {
                continue;
            }
            if let Some(reconnect) = self.paths[index].reconnect.as_mut() {
                let result = match reconnect.result.try_recv() {
                    Err(oneshot::error::TryRecvError::Empty) => continue,
                    Err(oneshot::error::TryRecvError::Closed) => None,
                    Ok(result) => Some(result),
                };
                self.paths[index].reconnect = None;
                match result.map(|connection| connection.and_then(|c| self.adopt(index, c))) {
                    Some(Ok(())) => {
                        tracing::debug!(address = %self.paths[index].address, "path reconnected");
                        continue;
                    }
                    Some(Err(error)) => {
                        tracing::debug!(address = %self.paths[index].address, %error, "reconnect failed");
                    }
                    None => {}
                }
            }
            let due = self.paths[index]
                .reconnect_started
                .is_none_or(|started| now.duration_since(started) >= MULTIPATH_RECONNECT_INTERVAL);
            if due {
                self.start_reconnect(index, now);
            }
        }
    }

    /// Starts a background reconnection of path `index`, bounded by the connect timeout.
    fn start_reconnect(&mut self, index: usize, now: Instant) {
        let (sender, result) = oneshot::channel();
        let attempt = open_path(
            self.paths[index].address.clone(),
            self.subnqn.clone(),
            self.options.clone(),
            self.queue_depth,
        );
        let timeout = self.connect_timeout();
        let timed_out = self.connect_timed_out(index);
        let task = tokio::spawn(async move {
            let result = tokio::time::timeout(timeout, attempt).await.unwrap_or(Err(timed_out));
            // The namespace may be gone by now: then nobody wants the connection.
            let _ = sender.send(result);
        });
        let path = &mut self.paths[index];
        path.reconnect = Some(Reconnect { task: task.abort_handle(), result });
        path.reconnect_started = Some(now);
    }

    /// Rereads the ANA log page of every live path, reconnects paths that are down (waiting for
    /// a background attempt in progress, else trying now whatever the reconnection interval),
    /// and picks the current path again. Each path's part is bounded by the I/O timeout or the
    /// connect timeout.
    pub async fn refresh(&mut self) -> Result<(), InitiatorError> {
        self.maintain_paths();
        for index in 0..self.paths.len() {
            if self.paths[index].connection.is_some() {
                self.reread_ana(index).await;
                continue;
            }
            if let Some(mut reconnect) = self.paths[index].reconnect.take() {
                let result = tokio::time::timeout(self.connect_timeout(), &mut reconnect.result)
                    .await
                    .unwrap_or_else(|_| Ok(Err(self.connect_timed_out(index))));
                let adopted = match result {
                    Ok(connection) => connection.and_then(|c| self.adopt(index, c)),
                    Err(_) => Err(self.connect_timed_out(index)),
                };
                if adopted.is_ok() {
                    continue;
                }
            }
            self.paths[index].reconnect_started = Some(Instant::now());
            if let Err(error) = self.connect_path(index).await {
                tracing::debug!(address = %self.paths[index].address, %error, "path down");
            }
        }
        self.current = None;
        self.select_path();
        Ok(())
    }

    /// Reads path `index`'s ANA log page again, within the I/O timeout; a path that fails to
    /// answer in time is down.
    async fn reread_ana(&mut self, index: usize) {
        let Some((controller, _)) = &self.paths[index].connection else { return };
        let error = match tokio::time::timeout(self.io_timeout, controller.refresh_ana()).await {
            Ok(Ok(())) => return,
            Ok(Err(error)) => error.to_string(),
            Err(_) => format!("no ANA log page within {} ms", self.io_timeout.as_millis()),
        };
        tracing::debug!(address = %self.paths[index].address, %error, "path down");
        self.abort_path(index);
    }

    /// Rereads the ANA log page of every live path (bounded as [`Self::reread_ana`]).
    async fn reread_all_ana(&mut self) {
        for index in 0..self.paths.len() {
            self.reread_ana(index).await;
        }
    }

    fn mark_down(&mut self, index: usize) {
        self.paths[index].connection = None;
    }

    /// Gives path `index` up: its I/O connection is reset (commands it holds unsent are
    /// discarded, not delivered later) and its controller dropped.
    fn abort_path(&mut self, index: usize) {
        if let Some((controller, queue)) = self.paths[index].connection.take() {
            queue.abort();
            drop(controller);
        }
    }

    /// Every path with its state now (ANA changes notified by the controllers show at once;
    /// a reconnected path shows once the namespace has been used or refreshed since).
    pub fn paths(&self) -> Vec<PathInfo> {
        self.paths
            .iter()
            .map(|path| PathInfo {
                address: path.address.clone(),
                cntlid: path.connection.as_ref().map(|(controller, _)| controller.cntlid()),
                state: path.state(self.nsid),
            })
            .collect()
    }

    /// The index (into [`MultipathNamespace::paths`]) of the path the next I/O goes to, from the
    /// paths' states now.
    pub fn current_path(&self) -> Option<usize> {
        self.choose(self.current)
    }

    /// How many times a command failed on a path (path status, broken connection or I/O
    /// timeout) and was tried again; a path change learnt from an ANA change notice costs none.
    pub fn failovers(&self) -> u64 {
        self.failovers
    }

    pub fn lba_size_bytes(&self) -> u32 {
        self.lba_size_bytes
    }

    /// The namespace size in blocks, as the current path's controller last identified it
    /// (namespace attribute notices update it), else as any live path's, else as at connect.
    pub fn size_blocks(&self) -> u64 {
        let live = |index: usize| {
            let (controller, _) = self.paths[index].connection.as_ref()?;
            controller.current_namespace().filter(|namespace| namespace.nsid == self.nsid)
        };
        self.current_path()
            .and_then(live)
            .or_else(|| (0..self.paths.len()).find_map(live))
            .map_or(self.size_blocks, |namespace| namespace.size_blocks)
    }

    /// Reads `length_bytes` from `lba`, failing over between paths. Dropping the future before
    /// it completes abandons the command: the path it was on is reset at the next command (a
    /// dropped write may or may not have landed), as after an I/O timeout.
    pub async fn read(
        &mut self,
        lba: u64,
        length_bytes: usize,
    ) -> Result<AlignedBuf, InitiatorError> {
        self.with_failover(&mut |queue| {
            let buffer = AlignedBuf::new(length_bytes);
            Box::pin(async move {
                let mut buffer = buffer;
                buffer.set_len(length_bytes);
                queue.read(lba, buffer).await
            })
        })
        .await
    }

    /// Writes `data` at `lba`, failing over between paths (cancelled as [`Self::read`] is).
    pub async fn write(&mut self, lba: u64, data: &[u8]) -> Result<(), InitiatorError> {
        self.with_failover(&mut |queue| {
            let mut buffer = AlignedBuf::new(data.len());
            buffer.set_len(data.len());
            buffer.copy_from_slice(data);
            Box::pin(async move { queue.write(lba, buffer).await.map(drop) })
        })
        .await
    }

    /// The error for a command that found no usable path in time.
    fn no_usable_path(&self) -> InitiatorError {
        InitiatorError::NoUsablePath {
            subnqn: self.subnqn.clone(),
            states: self
                .paths()
                .iter()
                .map(|path| format!("{} {:?}", path.address, path.state))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// Runs `command` on path `index` within the I/O timeout.
    async fn attempt<T>(
        &mut self,
        index: usize,
        command: &mut Command<'_, T>,
    ) -> Result<T, AttemptError> {
        let io_timeout = self.io_timeout;
        let Some((controller, queue)) = self.paths[index].connection.as_mut() else {
            unreachable!("a chosen path is connected");
        };
        let address = controller.address();
        self.in_flight = Some(index);
        let outcome = tokio::time::timeout(io_timeout, command(queue)).await;
        self.in_flight = None;
        let error = match outcome {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(error)) => error,
            Err(_) => {
                // The command is abandoned half-way: the queue cannot be trusted any more, and
                // whatever it still holds must not reach the controller later.
                self.abort_path(index);
                return Err(AttemptError::PathLost(InitiatorError::Timeout {
                    address,
                    operation: "an I/O command (multipath I/O timeout)",
                    timeout_ms: u64::try_from(io_timeout.as_millis()).unwrap_or(u64::MAX),
                }));
            }
        };
        if error.status().is_some_and(|status| status.is_path_error()) {
            return Err(AttemptError::PathStatus(error));
        }
        let broken = matches!(
            error,
            InitiatorError::ConnectionClosed { .. }
                | InitiatorError::Io { .. }
                | InitiatorError::Timeout { .. }
                | InitiatorError::Terminated { .. }
                | InitiatorError::MalformedPdu { .. }
                | InitiatorError::Protocol { .. }
                | InitiatorError::QueueBroken { .. }
        );
        if broken {
            self.abort_path(index);
            return Err(AttemptError::PathLost(error));
        }
        Err(AttemptError::Command(error))
    }

    /// Runs `command` on the current path; on a path error (status, broken connection, I/O
    /// timeout) rereads the ANA state and tries again on the path chosen then. Gives up after
    /// [`MULTIPATH_ATTEMPTS_MAX`] failed attempts, or once the failover timeout has passed since
    /// the first path error or the first time no path was usable.
    async fn with_failover<T>(
        &mut self,
        command: &mut Command<'_, T>,
    ) -> Result<T, InitiatorError> {
        // Each turn either sends the command down a path (at most MULTIPATH_ATTEMPTS_MAX of them
        // fail) or waits MULTIPATH_RETRY_DELAY at least, until the failover timeout has passed.
        let waits_max = self.failover_timeout.as_millis() / MULTIPATH_RETRY_DELAY.as_millis() + 1;
        let turns_max = MULTIPATH_ATTEMPTS_MAX + usize::try_from(waits_max).unwrap_or(usize::MAX);
        if let Some(index) = self.in_flight.take() {
            // The previous command was dropped half-way: its queue may still expect it.
            tracing::debug!(address = %self.paths[index].address, "resetting a path after a cancelled command");
            self.abort_path(index);
        }
        let mut attempts = 0;
        let mut trouble_since: Option<Instant> = None;
        let mut last_error = None;
        for _ in 0..turns_max {
            // The states may have changed since the last command (ANA change notices, paths
            // reconnected in the background).
            self.maintain_paths();
            self.select_path();
            let out_of_time = |since: Instant, timeout: Duration| since.elapsed() >= timeout;
            let Some(index) = self.current else {
                let since = *trouble_since.get_or_insert_with(Instant::now);
                if out_of_time(since, self.failover_timeout) {
                    break;
                }
                // No usable path: let a transition finish, then look again.
                tokio::time::sleep(MULTIPATH_RETRY_DELAY).await;
                self.reread_all_ana().await;
                continue;
            };
            if trouble_since.is_some_and(|since| out_of_time(since, self.failover_timeout)) {
                break;
            }
            let error = match self.attempt(index, command).await {
                Ok(value) => return Ok(value),
                Err(AttemptError::Command(error)) => return Err(error),
                Err(AttemptError::PathStatus(error)) => {
                    tracing::debug!(address = %self.paths[index].address, %error, "failing over");
                    // Like Linux after an ANA error: reread the path's ANA state before choosing
                    // again; a path that still calls itself usable gets a moment first.
                    self.reread_ana(index).await;
                    if self.choose(Some(index)) == Some(index) {
                        tokio::time::sleep(MULTIPATH_RETRY_DELAY).await;
                    }
                    error
                }
                Err(AttemptError::PathLost(error)) => {
                    tracing::debug!(address = %self.paths[index].address, %error, "path lost, failing over");
                    error
                }
            };
            last_error = Some(error);
            trouble_since.get_or_insert_with(Instant::now);
            self.failovers += 1;
            attempts += 1;
            if attempts >= MULTIPATH_ATTEMPTS_MAX {
                break;
            }
        }
        Err(last_error.unwrap_or_else(|| self.no_usable_path()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>(_: &T) {}

    /// Callers may run I/O in tasks of a multi-thread runtime (`tokio::spawn`).
    #[allow(dead_code, clippy::diverging_sub_expression)]
    fn io_futures_are_send(device: &mut MultipathNamespace) {
        assert_send(&device.read(0, 4096));
        assert_send(&device.write(0, &[]));
        assert_send(&device.refresh());
    }
}
