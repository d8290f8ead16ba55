//! NVMe over TCP for Ferrite: the wire format and the target state machines, sans-IO.
//!
//! **API Boundary:** this is the only crate that knows the NVMe/TCP wire format. The `initiator`
//! and the node's driver use its codec and state machines and write no byte layout of their own.
//!
//! - [`pdu`]: every NVMe/TCP PDU (ICReq, ICResp, H2CTermReq, C2HTermReq, CapsuleCmd,
//!   CapsuleResp, H2CData, C2HData, R2T), header and data digests (CRC32C), PDU data alignment,
//!   and an incremental decoder used by both ends that borrows its input and reports fatal errors
//!   with the fatal error status and field offset a termination request carries.
//! - [`command`]: the 64-byte SQE and 16-byte CQE, SGL descriptors, opcodes, Fabrics command
//!   types, status codes, Connect data, with builders for the commands Ferrite sends.
//! - [`structures`]: Identify, namespace descriptor, discovery log and other log page layouts.
//! - [`target`]: the target. [`target::Target`] is shared by all connections and holds the
//!   catalog of subsystems (supplied by the node through [`target::Catalog`]) and the registry of
//!   controllers (dynamic controller model, discovery subsystem on the same port).
//!   [`target::Queue`] is one connection: the driver feeds it bytes and gets back bytes to send
//!   and [`target::StorageRequest`]s to execute.
//!
//! **Architecture Invariant:** nothing here opens a socket or a file, spawns a thread or reads a
//! clock; time is an argument (`now_ms`). Bytes from the network are never `unwrap`ped: every
//! malformed input becomes a status or a clean termination of that one connection.
//!
//! What the target implements, its limits and constants are listed in `docs/nvme-tcp.md`.

pub mod command;
pub mod pdu;
pub mod structures;
pub mod target;
