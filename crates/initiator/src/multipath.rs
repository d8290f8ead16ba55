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

use std::time::Duration;

use nvmf::target::AnaState;
use types::{AlignedBuf, Nqn};

use crate::controller::{ConnectOptions, Controller};
use crate::error::InitiatorError;
use crate::io_queue::IoQueue;

/// Paths (controllers) of one multipath namespace at most.
pub const MULTIPATH_PATHS_MAX: usize = 16;
/// Attempts of one I/O across paths before its last error is returned.
pub const MULTIPATH_ATTEMPTS_MAX: usize = 2 * MULTIPATH_PATHS_MAX;
/// Pause before retrying when no path is usable (every path inaccessible or changing), so a
/// transition in progress can finish.
pub const MULTIPATH_RETRY_DELAY: Duration = Duration::from_millis(50);

/// What the host knows of one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    /// ANA optimized (also a controller that reports no ANA): preferred.
    Optimized,
    /// ANA non-optimized: used when no optimized path is left.
    NonOptimized,
    /// ANA inaccessible, persistent loss or change: not used until it changes.
    Inaccessible,
    /// The connection broke or never came up.
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

struct Path {
    address: String,
    /// The controller and its one I/O queue; None when down.
    connection: Option<(Controller, IoQueue)>,
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
}

impl std::fmt::Debug for MultipathNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultipathNamespace")
            .field("subnqn", &self.subnqn)
            .field("nsid", &self.nsid)
            .field("paths", &self.paths())
            .field("current", &self.current)
            .finish()
    }
}

impl MultipathNamespace {
    /// Connects a controller and one I/O queue of `queue_depth` on every address (each a port of
    /// the subsystem `subnqn`), reads each path's ANA state and picks the current path. Succeeds
    /// when at least one path connects; the others are kept as down and retried by
    /// [`MultipathNamespace::refresh`].
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
                .map(|address| Path { address: address.clone(), connection: None })
                .collect(),
            current: None,
            failovers: 0,
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
        device.select_path();
        Ok(device)
    }

    /// Connects path `index` (the controller reads its ANA state as it connects) and checks it
    /// reaches the same namespace as the others.
    async fn connect_path(&mut self, index: usize) -> Result<(), InitiatorError> {
        let address = self.paths[index].address.clone();
        let controller =
            Controller::connect(address.as_str(), &self.subnqn, self.options.clone()).await?;
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
        let queue = controller.open_io_queue(self.queue_depth).await?;
        self.paths[index].connection = Some((controller, queue));
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

    /// Rereads the ANA log page of every live path, reconnects paths that are down, and picks
    /// the current path again.
    pub async fn refresh(&mut self) -> Result<(), InitiatorError> {
        for index in 0..self.paths.len() {
            let read = match &self.paths[index].connection {
                Some((controller, _)) if controller.is_live() => controller.refresh_ana().await,
                _ => {
                    self.mark_down(index);
                    self.connect_path(index).await
                }
            };
            if let Err(error) = read {
                tracing::debug!(address = %self.paths[index].address, %error, "path down");
                self.mark_down(index);
            }
        }
        self.current = None;
        self.select_path();
        Ok(())
    }

    fn mark_down(&mut self, index: usize) {
        self.paths[index].connection = None;
    }

    /// Every path with its state now (ANA changes notified by the controllers show at once).
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

    /// How many times a command failed on a path (path status or broken connection) and was
    /// tried again; a path change learnt from an ANA change notice costs none.
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

    /// Reads `length_bytes` from `lba`, failing over between paths.
    pub async fn read(
        &mut self,
        lba: u64,
        length_bytes: usize,
    ) -> Result<AlignedBuf, InitiatorError> {
        self.with_failover(|queue| {
            let buffer = AlignedBuf::new(length_bytes);
            Box::pin(async move {
                let mut buffer = buffer;
                buffer.set_len(length_bytes);
                queue.read(lba, buffer).await
            })
        })
        .await
    }

    /// Writes `data` at `lba`, failing over between paths.
    pub async fn write(&mut self, lba: u64, data: &[u8]) -> Result<(), InitiatorError> {
        self.with_failover(|queue| {
            let mut buffer = AlignedBuf::new(data.len());
            buffer.set_len(data.len());
            buffer.copy_from_slice(data);
            Box::pin(async move { queue.write(lba, buffer).await.map(drop) })
        })
        .await
    }

    /// Runs `command` on the current path; on a path error marks the path, rereads the ANA
    /// states and tries again on the path chosen then, at most [`MULTIPATH_ATTEMPTS_MAX`] times.
    async fn with_failover<T, F>(&mut self, mut command: F) -> Result<T, InitiatorError>
    where
        F: for<'q> FnMut(
            &'q mut IoQueue,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, InitiatorError>> + 'q>,
        >,
    {
        let mut last_error = None;
        for _ in 0..MULTIPATH_ATTEMPTS_MAX {
            // The states may have changed since the last command (ANA change notices).
            self.select_path();
            let Some(index) = self.current else {
                // No usable path: let a transition finish, then look again.
                tokio::time::sleep(MULTIPATH_RETRY_DELAY).await;
                self.refresh().await?;
                continue;
            };
            let Some((_, queue)) = self.paths[index].connection.as_mut() else {
                self.current = None;
                continue;
            };
            match command(queue).await {
                Ok(value) => return Ok(value),
                Err(error) => {
                    let path_status = error.status().is_some_and(|status| status.is_path_error());
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
                    if !path_status && !broken {
                        return Err(error);
                    }
                    tracing::debug!(address = %self.paths[index].address, %error, "failing over");
                    if broken {
                        self.mark_down(index);
                    }
                    // Like Linux after an ANA error: reread the ANA states before choosing again.
                    self.failovers += 1;
                    last_error = Some(error);
                    self.refresh().await?;
                }
            }
        }
        Err(last_error.unwrap_or_else(|| InitiatorError::NoUsablePath {
            subnqn: self.subnqn.clone(),
            states: self
                .paths()
                .iter()
                .map(|path| format!("{} {:?}", path.address, path.state))
                .collect::<Vec<_>>()
                .join(", "),
        }))
    }
}
