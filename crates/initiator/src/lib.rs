//! The host side of NVMe/TCP, on tokio: connects to a controller, brings it up, opens I/O queues
//! and moves data, for Ferrite's tests and `ferrite bench`.
//!
//! [`Controller::connect`] opens the admin queue and enables the controller; [`Controller::
//! open_io_queue`] opens an [`IoQueue`] per TCP connection; [`discover`] reads a target's
//! discovery log; [`MultipathNamespace`] reaches one namespace through every port of its
//! subsystem and fails over between them as Linux's native multipath does, giving up a path
//! whose command outlives the I/O timeout and riding through a time without any usable path. Each I/O controller
//! keeps an Asynchronous Event Request outstanding and acts on ANA change and namespace
//! attribute notices as Linux does ([`Controller::async_events`]), so path states and sizes
//! change without an I/O error. Every wait is bounded by a named timeout, except the event
//! request's, which waits for an event and ends with the connection; every byte received is
//! checked against what was asked before it is used, and a violation is an [`InitiatorError`],
//! never a panic.
//!
//! With the `testing` feature, `testing::RamTarget` serves `nvmf`'s target over RAM on local
//! ports: a fixture for this crate's tests and for those of crates built on it.
//!
//! **API Boundary:** the wire format is `nvmf`'s; this crate calls its encoders and decoders and
//! writes no PDU or command layout of its own, except the Asynchronous Event Request completion
//! dword, whose layout `nvmf` keeps private to its target (see `events.rs`).

mod admin;
mod controller;
mod discovery;
mod error;
mod events;
mod host;
mod io_queue;
mod multipath;
mod queue;
#[cfg(feature = "testing")]
pub mod testing;

pub use controller::{
    ConnectOptions, Controller, Namespace, ACTIVE_NAMESPACE_PAGES_MAX, ADMIN_TRANSFER_BYTES,
    COMMAND_TIMEOUT_DEFAULT, CONNECT_TIMEOUT_DEFAULT, IO_QUEUES_REQUESTED_DEFAULT,
    KEEP_ALIVE_TIMEOUT_DEFAULT, READY_TIMEOUT_MAX, READY_TIMEOUT_MIN, SHUTDOWN_TIMEOUT,
    STATUS_POLL_INTERVAL,
};
pub use discovery::{
    discover, discover_with, DiscoveryEntry, DISCOVERY_ATTEMPTS_MAX, DISCOVERY_RECORDS_MAX,
};
pub use error::{fatal_error_name, status_name, InitiatorError};
pub use events::{
    event_type, notice, AnaGroupState, AsyncEvent, AsyncEventState, ASYNC_EVENT_ANA_CHANGE,
    ASYNC_EVENT_NAMESPACE_ATTRIBUTE, ASYNC_EVENT_REQUESTS,
};
pub use host::{default_host, HostIdentity};
pub use io_queue::{IoQueue, LbaRange, WRITE_ZEROES_BLOCKS_MAX};
pub use multipath::{
    MultipathNamespace, PathInfo, PathState, MULTIPATH_ATTEMPTS_MAX,
    MULTIPATH_FAILOVER_TIMEOUT_DEFAULT, MULTIPATH_IO_TIMEOUT_DEFAULT, MULTIPATH_PATHS_MAX,
    MULTIPATH_RECONNECT_INTERVAL, MULTIPATH_RETRY_DELAY, MULTIPATH_TIMEOUT_MAX,
};
pub use nvmf::command::Status;
pub use nvmf::structures::IdentifyController;
pub use nvmf::target::AnaState;
pub use queue::{
    Completion, ADMIN_IN_CAPSULE_BYTES, ADMIN_QUEUE_DEPTH, COMMAND_TRANSFER_BYTES_MAX,
    QUEUE_DEPTH_MAX,
};
pub use types::{AlignedBuf, Nqn};
