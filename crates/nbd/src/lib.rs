//! The NBD (Network Block Device) protocol for Ferrite's NBD frontend, sans-IO.
//!
//! **API Boundary:** this is the only crate that knows the NBD wire format. The node's NBD driver
//! and any test or benchmark client use its codec and state machine and write no byte layout of
//! their own.
//!
//! - [`wire`]: magics, flags and codes, and the encoders and decoders of the greeting, options,
//!   option replies, requests, simple replies and structured reply chunks (both directions).
//! - [`server`]: the server. [`server::Connection`] is one TCP connection: the driver feeds it
//!   bytes and gets back bytes to send and [`server::Request`]s to execute. The node supplies the
//!   exports through [`server::Catalog`].
//!
//! **Architecture Invariant:** nothing here opens a socket or a file, spawns a thread or reads a
//! clock; time is an argument (`now_ms`). Bytes from the network are never `unwrap`ped: every
//! malformed input becomes an error reply or a clean close of that one connection.
//!
//! What is implemented, the byte layouts sent, the limits, and what is refused with which error
//! are listed in `docs/nbd.md`.

pub mod server;
pub mod wire;
