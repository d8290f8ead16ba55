//! The initiator's one error type, with messages that say what happened, to which controller or
//! queue, and what to do about it, plus readable names for the NVMe status codes it reports.

use std::net::SocketAddr;

use nvmf::command::Status;
use nvmf::pdu::PduError;
use types::Nqn;

/// Why an initiator operation failed. Per-command failures of the pipelined API are not errors
/// (they come back as a [`crate::Completion`] with a status); everything here is either a failed
/// set-up step or a broken connection.
#[derive(Debug, thiserror::Error)]
pub enum InitiatorError {
    #[error("cannot resolve NVMe/TCP address {address:?}: {source}")]
    Resolve {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "connect to {address} refused: is `ferrite up` running and serving NVMe/TCP on that port?"
    )]
    ConnectRefused { address: SocketAddr },
    #[error("connect to {address} failed: {source}")]
    Connect {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "no answer from {address} to {operation} within {timeout_ms} ms: the target is hung, \
         overloaded or unreachable"
    )]
    Timeout { address: SocketAddr, operation: &'static str, timeout_ms: u64 },
    #[error(
        "{address} closed the connection (queue {qid}) during {during}: check the target's log"
    )]
    ConnectionClosed { address: SocketAddr, qid: u16, during: &'static str },
    #[error("network error on the connection to {address} (queue {qid}): {source}")]
    Io {
        address: SocketAddr,
        qid: u16,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed PDU from {address} (queue {qid}): {source}; the connection was terminated")]
    MalformedPdu {
        address: SocketAddr,
        qid: u16,
        #[source]
        source: PduError,
    },
    #[error(
        "protocol violation by the controller at {address} (queue {qid}): {problem}; the \
         connection was terminated (a bug in the target)"
    )]
    Protocol { address: SocketAddr, qid: u16, problem: String },
    #[error(
        "the controller at {address} terminated the connection (queue {qid}): fatal error status \
         {fes:#06x} ({}), information {fei:#x}", fatal_error_name(*fes)
    )]
    Terminated { address: SocketAddr, qid: u16, fes: u16, fei: u32 },
    #[error("{address} does not speak NVMe/TCP as this initiator does: {problem}")]
    Unsupported { address: SocketAddr, problem: String },
    #[error(
        "controller at {address} rejected Connect for {subnqn} (queue {qid}): status {:#06x} ({}){}",
        status.raw(), status_name(*status), connect_hint(*status, *result)
    )]
    ConnectRejected { address: SocketAddr, subnqn: Nqn, qid: u16, status: Status, result: u32 },
    #[error("{command} failed on the controller at {address}: status {:#06x} ({})", status.raw(), status_name(*status))]
    CommandFailed { address: SocketAddr, command: &'static str, status: Status },
    #[error("the controller at {address} reported a fatal status (CSTS.CFS) while {during}; reset it or restart the target")]
    ControllerFatal { address: SocketAddr, during: &'static str },
    #[error(
        "the controller at {address} did not become ready within {timeout_ms} ms after enabling it"
    )]
    ControllerNotReady { address: SocketAddr, timeout_ms: u64 },
    #[error("the controller at {address} did not finish its shutdown within {timeout_ms} ms")]
    ShutdownTimeout { address: SocketAddr, timeout_ms: u64 },
    #[error("namespace {nsid} of {subnqn} is not usable: {problem}")]
    Namespace { subnqn: Nqn, nsid: u32, problem: String },
    #[error("subsystem {subnqn} has no active namespace: is the volume still being created?")]
    NoNamespace { subnqn: Nqn },
    #[error(
        "controller {cntlid} at {address} allows {allowed} I/O queue(s) and all were opened \
         (queue ids are not reused): connect a new controller for more"
    )]
    TooManyQueues { address: SocketAddr, cntlid: u16, allowed: u16 },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("queue {qid} to {address} is broken by an earlier error ({reason}); drop it and open a new one")]
    QueueBroken { address: SocketAddr, qid: u16, reason: String },
    #[error(
        "no usable path to {subnqn} ({states}): every path is inaccessible, changing or down; \
         check the node's ANA states and that its listeners are reachable"
    )]
    NoUsablePath { subnqn: Nqn, states: String },
    #[error(
        "connecting path {address} of {subnqn} took over {timeout_ms} ms: the target is hung, \
         overloaded or unreachable"
    )]
    PathConnectTimeout { address: String, subnqn: Nqn, timeout_ms: u64 },
    #[error(
        "the discovery log at {address} changed {attempts} times while it was read; try again \
         when the target's configuration settles"
    )]
    DiscoveryUnstable { address: SocketAddr, attempts: u32 },
}

impl InitiatorError {
    /// The NVMe status of a command the controller failed, if this error is one.
    pub fn status(&self) -> Option<Status> {
        match self {
            InitiatorError::ConnectRejected { status, .. }
            | InitiatorError::CommandFailed { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// What a Connect rejection most likely means, for the user.
fn connect_hint(status: Status, result: u32) -> String {
    if status.same_code(Status::CONNECT_INVALID_PARAMETERS) {
        let in_data = result & (1 << 16) != 0;
        let offset = result & 0xFFFF;
        let field = match (in_data, offset) {
            (true, 256) => " (the subsystem NQN: no such subsystem; check the volume name with `ferrite volume list`)",
            (true, 512) => " (the host NQN: this host is not allowed)",
            (true, 16) => " (the controller ID)",
            (true, _) => "",
            (false, _) => " (in the command)",
        };
        let place = if in_data { "Connect data" } else { "Connect command" };
        format!("; invalid field at byte {offset} of the {place}{field}")
    } else if status.same_code(Status::CONNECT_INVALID_HOST) {
        "; this host NQN is not allowed to access the subsystem".to_owned()
    } else if status.same_code(Status::CONTROLLER_BUSY) {
        "; the queue id is in use or the controller is busy, try again".to_owned()
    } else {
        String::new()
    }
}

/// A readable name for an NVMe status (type and code; DNR and More are ignored).
pub fn status_name(status: Status) -> &'static str {
    const NAMES: &[(Status, &str)] = &[
        (Status::SUCCESS, "Successful Completion"),
        (Status::INVALID_OPCODE, "Invalid Command Opcode"),
        (Status::INVALID_FIELD, "Invalid Field in Command"),
        (Status::COMMAND_ID_CONFLICT, "Command ID Conflict"),
        (Status::DATA_TRANSFER_ERROR, "Data Transfer Error"),
        (Status::INTERNAL_ERROR, "Internal Error"),
        (Status::ABORT_REQUESTED, "Command Abort Requested"),
        (Status::INVALID_NAMESPACE_OR_FORMAT, "Invalid Namespace or Format"),
        (Status::COMMAND_SEQUENCE_ERROR, "Command Sequence Error"),
        (Status::INVALID_SGL_SEGMENT_DESCRIPTOR, "Invalid SGL Segment Descriptor"),
        (Status::INVALID_SGL_DESCRIPTOR_COUNT, "Invalid Number of SGL Descriptors"),
        (Status::DATA_SGL_LENGTH_INVALID, "Data SGL Length Invalid"),
        (Status::SGL_DESCRIPTOR_TYPE_INVALID, "SGL Descriptor Type Invalid"),
        (Status::SGL_OFFSET_INVALID, "SGL Offset Invalid"),
        (Status::NAMESPACE_WRITE_PROTECTED, "Namespace is Write Protected"),
        (Status::TRANSIENT_TRANSPORT_ERROR, "Transient Transport Error"),
        (Status::LBA_OUT_OF_RANGE, "LBA Out of Range"),
        (Status::CAPACITY_EXCEEDED, "Capacity Exceeded"),
        (Status::NAMESPACE_NOT_READY, "Namespace Not Ready"),
        (Status::INVALID_QUEUE_IDENTIFIER, "Invalid Queue Identifier"),
        (Status::INVALID_QUEUE_SIZE, "Invalid Queue Size"),
        (Status::INVALID_LOG_PAGE, "Invalid Log Page"),
        (Status::FEATURE_NOT_CHANGEABLE, "Feature Identifier Not Changeable"),
        (
            Status::CONNECT_INCOMPATIBLE_FORMAT,
            "Connect Incompatible Format / Conflicting Attributes",
        ),
        (Status::CONTROLLER_BUSY, "Controller Busy"),
        (Status::CONNECT_INVALID_PARAMETERS, "Connect Invalid Parameters"),
        (Status::CONNECT_RESTART_DISCOVERY, "Connect Restart Discovery"),
        (Status::CONNECT_INVALID_HOST, "Connect Invalid Host"),
        (Status::INVALID_QUEUE_TYPE, "Invalid Queue Type"),
        (Status::DISCOVER_RESTART, "Discover Restart"),
        (Status::AUTHENTICATION_REQUIRED, "Authentication Required"),
        (Status::WRITE_FAULT, "Write Fault"),
        (Status::UNRECOVERED_READ_ERROR, "Unrecovered Read Error"),
        (Status::ACCESS_DENIED, "Access Denied"),
        (Status::INTERNAL_PATH_ERROR, "Internal Path Error"),
        (Status::ANA_PERSISTENT_LOSS, "Asymmetric Access Persistent Loss"),
        (Status::ANA_INACCESSIBLE, "Asymmetric Access Inaccessible"),
        (Status::ANA_TRANSITION, "Asymmetric Access Transition"),
    ];
    NAMES
        .iter()
        .find(|(known, _)| known.same_code(status))
        .map(|(_, name)| *name)
        .unwrap_or("unknown status")
}

/// A readable name for a termination request's fatal error status.
pub fn fatal_error_name(fes: u16) -> &'static str {
    use nvmf::pdu::FatalErrorStatus as Fes;
    const NAMES: &[(Fes, &str)] = &[
        (Fes::InvalidHeaderField, "Invalid PDU Header Field"),
        (Fes::PduSequenceError, "PDU Sequence Error"),
        (Fes::HeaderDigestError, "Header Digest Error"),
        (Fes::DataTransferOutOfRange, "Data Transfer Out of Range"),
        (Fes::DataTransferLimitExceeded, "Data Transfer Limit Exceeded"),
        (Fes::UnsupportedParameter, "Unsupported Parameter"),
    ];
    NAMES.iter().find(|(known, _)| *known as u16 == fes).map(|(_, name)| *name).unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_rejection_names_status_and_field() {
        let error = InitiatorError::ConnectRejected {
            address: "127.0.0.1:4420".parse().unwrap(),
            subnqn: Nqn::new("nqn.2024-01.io.ferrite:vol:nope").unwrap(),
            qid: 0,
            status: Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
            result: nvmf::command::connect_invalid_parameter_result(true, 256),
        };
        let message = error.to_string();
        assert!(
            message.contains("rejected Connect for nqn.2024-01.io.ferrite:vol:nope"),
            "{message}"
        );
        assert!(message.contains("status 0x4182 (Connect Invalid Parameters)"), "{message}");
        assert!(message.contains("no such subsystem"), "{message}");
        assert_eq!(error.status().map(Status::raw), Some(0x4182));
    }

    #[test]
    fn names_cover_known_codes() {
        assert_eq!(status_name(Status::LBA_OUT_OF_RANGE.with_dnr()), "LBA Out of Range");
        assert_eq!(status_name(Status::from_raw(0x07FF)), "unknown status");
        assert_eq!(fatal_error_name(3), "Header Digest Error");
        assert_eq!(fatal_error_name(0x99), "unknown");
    }
}
