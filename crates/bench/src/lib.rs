//! The engine of `ferrite bench`: the five standard workloads against any block target that
//! implements [`Connector`] and [`BlockQueue`], with HDR latency percentiles, an optional fill,
//! end-to-end data verification ([`VerifyMap`]), a live progress line, a table and JSON lines.
//!
//! The pieces, in the order a run uses them: [`BenchArgs`] (the command line) gives a
//! [`BenchConfig`] and a [`TargetUrl`]; the caller builds a connector for the target (the
//! `initiator` crate for NVMe/TCP) and calls [`run_command`], or [`run`] for the reports alone;
//! [`render_table`] and [`write_json_lines`] print them. A crash test drives [`run_verified`] with
//! its own [`VerifyMap`], saves it, restarts the server and calls [`VerifyMap::check_all`].

mod args;
mod engine;
pub mod local;
mod output;
mod progress;
mod run;
mod target;
mod url;
mod verify;
mod workload;

use std::error::Error;
use std::path::PathBuf;

pub use args::{run_command, BenchArgs};
pub use output::{format_latency_us, group_digits, json_line, render_table, write_json_lines};
pub use run::{
    run, run_verified, BenchConfig, CheckOptions, CheckReport, LatencySummary, WorkloadReport,
    CHECK_IO_SIZE_BYTES, FILL_IO_SIZE_BYTES, PHASE_DURATION_MAX, QUEUE_COUNT_MAX, QUEUE_DEPTH_MAX,
    WORKLOADS_MAX,
};
pub use target::{
    AlignedBuf, BlockQueue, Connector, IoCompletion, IoKind, IoRequest, IoStatus,
    IO_ALIGNMENT_BYTES, IO_SIZE_BYTES_MAX,
};
pub use url::{
    NbdTarget, NvmeTcpTarget, TargetUrl, TargetUrlError, NBD_PORT_DEFAULT, NVME_TCP_PORT_DEFAULT,
};
pub use verify::{
    ExpectedWrites, Mismatch, MismatchKind, VerifyMap, VerifyMapError, MISMATCH_EXAMPLES_MAX,
    VERIFY_BLOCK_BYTES, VERIFY_REGION_BYTES_MAX,
};
pub use workload::{Workload, STANDARD_WORKLOADS};

/// Why a bench run stopped or failed. Messages say what happened and what to do.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    TargetUrl(#[from] TargetUrlError),
    #[error("NBD targets arrive with the NBD frontend; use nvme+tcp:// for now")]
    NbdNotSupported,
    #[error("invalid bench options: {0}")]
    InvalidConfig(String),
    #[error("connecting to the target failed")]
    Connect(#[source] Box<dyn Error + Send + Sync>),
    #[error("I/O queue {queue} to the target failed; the run stopped")]
    QueueFailed {
        queue: u16,
        #[source]
        source: Box<dyn Error + Send + Sync>,
    },
    #[error("I/O queue {queue} broke the BlockQueue contract (a bug in the initiator): {problem}")]
    QueueContract { queue: u16, problem: String },
    #[error(
        "the target failed {errors} write(s) of the fill (first NVMe status {first_status:#06x})"
    )]
    FillFailed { errors: u64, first_status: u16 },
    #[error("block {lba} was written 2^28 times in one verifying run, the most the verify map counts; start a new run")]
    VerifyCounterExhausted { lba: u64 },
    #[error("verify map file {}", path.display())]
    VerifyMapIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("verify map file {} is not usable", path.display())]
    VerifyMapInvalid {
        path: PathBuf,
        #[source]
        source: VerifyMapError,
    },
    #[error("writing results to {}", path.display())]
    Output {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("verification failed: {mismatches} block(s) read back wrong (first ones above)")]
    VerifyFailed { mismatches: u64 },
    #[error("the target failed {errors} I/O command(s) (first NVMe status {first_status:#06x})")]
    IoErrors { errors: u64, first_status: u16 },
}

pub mod nvme;
