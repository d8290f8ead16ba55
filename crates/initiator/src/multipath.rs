//! Native NVMe multipath for one namespace, done the way the Linux host does it: connect a
//! controller on every path (port) of the subsystem, learn each path's Asymmetric Namespace
//! Access state from the ANA log page, send I/O down the first optimized path (else the first
//! non-optimized one), and on a path error (a path related status such as ANA Inaccessible, or a
//! broken connection) mark the path, reread the ANA states and retry the command on another
//! path. Command errors that are not about the path (LBA out of range, ...) are returned as they
//! are, as Linux does.
//!
//! ANA changes are learnt from path errors and from [`MultipathNamespace::refresh`]; this
//! initiator submits no Asynchronous Event Requests. Each retry copies the command's data again
//! (a write's data is kept by the caller's slice), so this is for tests and tools, not a hot
//! path.

use std::time::Duration;

use nvmf::command::{log_page, Sqe, NSID_ALL};
use nvmf::structures::{ana_state, cmic, AnaLog};
use types::{AlignedBuf, Nqn};

use crate::controller::{ConnectOptions, Controller, ADMIN_TRANSFER_BYTES};
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
    fn from_ana(code: u8) -> PathState {
        match code {
            ana_state::OPTIMIZED => PathState::Optimized,
            ana_state::NON_OPTIMIZED => PathState::NonOptimized,
            _ => PathState::Inaccessible,
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
    state: PathState,
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
                .map(|address| Path {
                    address: address.clone(),
                    connection: None,
                    state: PathState::Down,
                })
                .collect(),
            current: None,
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

    /// Connects path `index`, checks it reaches the same namespace as the others, and reads its
    /// ANA state.
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
        let state = read_path_state(&controller, self.nsid).await?;
        let queue = controller.open_io_queue(self.queue_depth).await?;
        self.paths[index].connection = Some((controller, queue));
        self.paths[index].state = state;
        Ok(())
    }

    /// Linux's path choice: keep the current path while it is optimized; else the first
    /// optimized path, else the first non-optimized one.
    fn select_path(&mut self) {
        if let Some(current) = self.current {
            if self.paths[current].state == PathState::Optimized {
                return;
            }
        }
        let first = |wanted: PathState| self.paths.iter().position(|path| path.state == wanted);
        self.current = first(PathState::Optimized).or_else(|| first(PathState::NonOptimized));
    }

    /// Rereads the ANA state of every connected path, reconnects paths that are down, and
    /// picks the current path again.
    pub async fn refresh(&mut self) -> Result<(), InitiatorError> {
        for index in 0..self.paths.len() {
            let state = match &self.paths[index].connection {
                Some((controller, _)) => read_path_state(controller, self.nsid).await,
                None => match self.connect_path(index).await {
                    Ok(()) => continue,
                    Err(error) => Err(error),
                },
            };
            match state {
                Ok(state) => self.paths[index].state = state,
                Err(error) => {
                    tracing::debug!(address = %self.paths[index].address, %error, "path down");
                    self.mark_down(index);
                }
            }
        }
        self.current = None;
        self.select_path();
        Ok(())
    }

    fn mark_down(&mut self, index: usize) {
        self.paths[index].connection = None;
        self.paths[index].state = PathState::Down;
    }

    /// Every path with its state.
    pub fn paths(&self) -> Vec<PathInfo> {
        self.paths
            .iter()
            .map(|path| PathInfo {
                address: path.address.clone(),
                cntlid: path.connection.as_ref().map(|(controller, _)| controller.cntlid()),
                state: path.state,
            })
            .collect()
    }

    /// The index (into [`MultipathNamespace::paths`]) of the path I/O goes to now.
    pub fn current_path(&self) -> Option<usize> {
        self.current
    }

    pub fn lba_size_bytes(&self) -> u32 {
        self.lba_size_bytes
    }

    pub fn size_blocks(&self) -> u64 {
        self.size_blocks
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
            let Some(index) = self.current else {
                // No usable path: let a transition finish, then look again.
                tokio::time::sleep(MULTIPATH_RETRY_DELAY).await;
                self.refresh().await?;
                continue;
            };
            let Some((_, queue)) = self.paths[index].connection.as_mut() else {
                self.mark_down(index);
                self.current = None;
                self.select_path();
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
                    } else {
                        self.paths[index].state = PathState::Inaccessible;
                    }
                    last_error = Some(error);
                    self.refresh().await?;
                }
            }
        }
        Err(last_error.unwrap_or_else(|| {
            InitiatorError::InvalidRequest(format!("no usable path to {}", self.subnqn))
        }))
    }
}

/// The ANA state of namespace `nsid` through `controller`: optimized when the controller does
/// not report ANA.
async fn read_path_state(controller: &Controller, nsid: u32) -> Result<PathState, InitiatorError> {
    let identify = controller.identify_controller();
    if identify.cmic & cmic::ANA_REPORTING == 0 {
        return Ok(PathState::Optimized);
    }
    let wanted = 16 + 32 * identify.nanagrpid as usize + 4 * identify.mnan as usize;
    let length = wanted.clamp(64, ADMIN_TRANSFER_BYTES).next_multiple_of(4);
    let sqe = Sqe::get_log_page(0, NSID_ALL, log_page::ANA, 0, length as u32);
    let mut buffer = AlignedBuf::new(length);
    buffer.set_len(length);
    let completion = controller.admin_command(sqe, Some(buffer), "Get Log Page (ANA)").await?;
    let data = completion.buffer.expect("a command that reads data returns its buffer");
    let log = AnaLog::decode(&data).ok_or_else(|| InitiatorError::Protocol {
        address: controller.address(),
        qid: 0,
        problem: "the ANA log page is malformed".to_owned(),
    })?;
    let group = log
        .groups
        .iter()
        .find(|group| group.nsids.contains(&nsid))
        .or_else(|| (log.groups.len() == 1).then(|| &log.groups[0]));
    Ok(group.map_or(PathState::Inaccessible, |group| PathState::from_ana(group.state)))
}
