//! The NBD server, sans-IO: the export catalog the node supplies and the per-connection state
//! machine.
//!
//! Every TCP connection is one [`Connection`]. The node's driver owns the socket; it feeds the
//! connection the bytes it received, sends the bytes the connection produces, executes the
//! [`Request`]s it yields against the volume and hands each result back with
//! [`Connection::complete`]. During the handshake the connection asks the [`Catalog`] which
//! exports exist; after it, the export is fixed for the life of the connection.
//!
//! Connections are independent of one another: a client may open several to one export
//! (NBD_FLAG_CAN_MULTI_CONN is advertised), which is correct because Ferrite has no per-connection
//! cache: a write is durable when it completes, so a flush or FUA on one connection covers the
//! writes completed on every other.
//!
//! **Architecture Invariant:** nothing here touches sockets, files, clocks or threads; time is an
//! argument (`now_ms`).

mod connection;
mod pool;
#[cfg(test)]
mod tests;

pub use connection::{Connection, ConnectionError, Phase, Request, RequestId, RequestKind};

use crate::wire::{handshake_flag, BlockSizes};

/// The minimum block size advertised in NBD_INFO_BLOCK_SIZE: Ferrite's logical block. Every
/// offset and length must be a multiple of it; others are refused with EINVAL.
pub const BLOCK_BYTES_MIN: u32 = types::LOGICAL_BLOCK_SIZE_BYTES;
/// The preferred block size: requests of this size and alignment need no read-modify-write.
pub const BLOCK_BYTES_PREFERRED: u32 = types::BLOCK_SIZE_BYTES;
/// The maximum payload of one READ or WRITE (32 MiB, the size the protocol tells every server to
/// accept). TRIM and WRITE_ZEROES carry no payload and may cover more.
pub const PAYLOAD_BYTES_MAX: u32 = 32 << 20;
/// Requests of one connection that are admitted and not yet completed (receiving write data,
/// queued for the driver or with it). At the limit the connection reads no further request until
/// one completes, which pushes back on the client through TCP.
pub const INFLIGHT_REQUESTS_MAX: usize = 128;
/// Data bytes held by the admitted requests of one connection (write payloads and read buffers).
pub const INFLIGHT_PAYLOAD_BYTES_MAX: u64 = 64 << 20;
/// Output bytes waiting to be sent above which the connection consumes no more input.
pub const OUTPUT_PENDING_BYTES_MAX: usize = 64 << 20;
/// The largest option data accepted; a longer option is skipped and refused with
/// NBD_REP_ERR_TOO_BIG. Room for the longest name (4096 bytes) in NBD_OPT_GO and many info types.
pub const OPTION_DATA_BYTES_MAX: u32 = 8192;
/// Options one connection may send before entering transmission; beyond, the connection closes.
pub const OPTIONS_PER_CONNECTION_MAX: u32 = 65_536;
/// Exports listed in the answer to NBD_OPT_LIST; beyond, exports are left out.
pub const EXPORTS_LISTED_MAX: usize = 4096;
/// A connection that has not entered transmission within this time should be closed.
pub const HANDSHAKE_DEADLINE_MS: u64 = 30_000;
/// Idle buffer bytes each connection keeps for reuse.
pub const BUFFER_RETAINED_BYTES_MAX: usize = 16 << 20;
/// The handshake flags of the greeting: fixed newstyle, and the client may skip the zero padding.
pub const HANDSHAKE_FLAGS: u16 = handshake_flag::FIXED_NEWSTYLE | handshake_flag::NO_ZEROES;
/// The size constraints every export advertises.
pub const BLOCK_SIZES: BlockSizes = BlockSizes {
    minimum_bytes: BLOCK_BYTES_MIN,
    preferred_bytes: BLOCK_BYTES_PREFERRED,
    maximum_payload_bytes: PAYLOAD_BYTES_MAX,
};

// The protocol's rules for advertised sizes: powers of two, a minimum of at most 64 KiB, a
// preferred size of at least max(minimum, 512), a maximum payload of at least the preferred size.
const _: () = assert!(BLOCK_BYTES_MIN.is_power_of_two() && BLOCK_BYTES_MIN <= 65_536);
const _: () = assert!(BLOCK_BYTES_PREFERRED.is_power_of_two());
const _: () = assert!(BLOCK_BYTES_PREFERRED >= BLOCK_BYTES_MIN && BLOCK_BYTES_PREFERRED >= 512);
const _: () = assert!(PAYLOAD_BYTES_MAX >= BLOCK_BYTES_PREFERRED);
const _: () = assert!(PAYLOAD_BYTES_MAX % BLOCK_BYTES_MIN == 0);
// One request of the largest payload always fits, so a lone request is never refused admission.
const _: () = assert!(PAYLOAD_BYTES_MAX as u64 <= INFLIGHT_PAYLOAD_BYTES_MAX);
// A read reply (one OFFSET_DATA chunk: the data and an 8-byte offset) fits the 32-bit length.
const _: () = assert!((PAYLOAD_BYTES_MAX as u64) + 8 <= u32::MAX as u64);
const _: () = assert!(INFLIGHT_REQUESTS_MAX <= u16::MAX as usize);
const _: () = assert!(OPTION_DATA_BYTES_MAX as usize >= 4 + crate::wire::STRING_BYTES_MAX + 2);

// A connection moves to the thread that serves its socket; requests move to storage threads.
const _: fn() = || {
    fn movable<T: Send>() {}
    movable::<Connection>();
    movable::<Request>();
};

/// One export: a volume (or a snapshot) as NBD clients see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// The export name clients ask for (`nbd://HOST:PORT/NAME`).
    pub name: String,
    /// Size in bytes: a multiple of [`BLOCK_BYTES_MIN`] (an export of another size is refused).
    pub size_bytes: u64,
    /// Writes, trims and write-zeroes are refused with EPERM (snapshots are read-only).
    pub read_only: bool,
    /// Free text shown to people by `nbdinfo`; may be empty.
    pub description: String,
}

/// What the node tells NBD connections about its exports. Called during the handshake only,
/// never per I/O.
pub trait Catalog: Send + Sync {
    /// Every export, for NBD_OPT_LIST.
    fn list(&self) -> Vec<ExportInfo>;
    /// The export named `name`, or None. The empty name is the protocol's "default export";
    /// the catalog decides whether there is one.
    fn lookup(&self, name: &str) -> Option<ExportInfo>;
    /// Why `name`, which [`Catalog::lookup`] did not give, names something that exists but is
    /// not served over NBD (an access policy), in words for people; None if nothing by that name
    /// exists. Asked only after `lookup` returned None. NBD_OPT_INFO and NBD_OPT_GO are then
    /// refused with NBD_REP_ERR_POLICY and this message instead of NBD_REP_ERR_UNKNOWN.
    fn refusal(&self, name: &str) -> Option<String> {
        let _ = name;
        None
    }
}
