//! Malformed and out-of-range input against a real `ferrite up`: raw TCP connections send broken
//! NVMe/TCP (garbage, a wrong PDU format version, a truncated PDU, a command before ICReq, a PLEN
//! far above the limit, a bad HLEN, a second ICReq) while one healthy initiator connection keeps
//! doing verified I/O. Each bad connection must end with a C2HTermReq then close, or a clean
//! close - never a hang and never a node crash - and afterwards the healthy connection and the
//! REST API still work. Commands with an LBA beyond the namespace, or a transfer above MDTS sent
//! raw, must fail with an NVMe status and leave the queue working.

mod common;

use common::{
    assert_no_error_lines, ferrite_ok, free_port, pattern, pattern_mismatch, runtime, volume_nqn,
    Node, BLOCK_BYTES,
};
use initiator::{AlignedBuf, ConnectOptions, Controller, InitiatorError, IoQueue, Status};
use nvmf::command::{ConnectData, SglDescriptor, Sqe, CONNECT_DATA_BYTES};
use nvmf::pdu::{self, Decoded, FatalErrorStatus, Framing, ICReq, Pdu, PduType, Role, PFV_1_0};
use nvmf::target::{IN_CAPSULE_DATA_BYTES_MAX, PDU_SIZE_MAX, TRANSFER_BYTES_MAX};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const VOLUME: &str = "fuzzed";
const VOLUME_BYTES: u64 = 64 << 20;
const VOLUME_BLOCKS: u64 = VOLUME_BYTES / BLOCK_BYTES as u64;
/// A bad connection must be answered and closed within this time.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes read from a probe connection at most (a termination request is at most 152).
const PROBE_RESPONSE_BYTES_MAX: usize = 64 * 1024;
/// The healthy loop cycles over this many 8 KiB slots at the start of the volume.
const HEALTHY_SLOTS: u64 = 256;
const HEALTHY_BLOCKS_PER_IO: usize = 2;
/// After the probes the healthy loop must complete this many more iterations.
const HEALTHY_PROGRESS_MIN: u64 = 20;
const HEALTHY_PROGRESS_TIMEOUT: Duration = Duration::from_secs(10);

/// How a probe connection ended.
#[derive(Debug)]
struct ProbeOutcome {
    /// The PDUs received, in order: their type and, for termination requests, FES and FEI.
    pdus: Vec<(PduType, Option<(u16, u32)>)>,
    /// The connection ended by FIN (true) or by reset (false).
    clean_eof: bool,
}

/// Sends `bytes` on a new connection (then half-closes if `half_close`), reads until the node
/// closes, and decodes what came back.
async fn probe(address: &str, bytes: &[u8], half_close: bool) -> ProbeOutcome {
    let mut stream = TcpStream::connect(address).await.expect("connect a probe");
    stream.write_all(bytes).await.expect("send the probe");
    if half_close {
        stream.shutdown().await.expect("half-close the probe");
    }
    let mut received = Vec::new();
    let mut chunk = vec![0u8; 4096];
    let deadline = Instant::now() + PROBE_TIMEOUT;
    let clean_eof = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut chunk)).await {
            Err(_) => panic!(
                "the node neither answered nor closed the connection within {PROBE_TIMEOUT:?} \
                 after {} bytes (first 16: {:02x?}); received {} bytes",
                bytes.len(),
                &bytes[..bytes.len().min(16)],
                received.len()
            ),
            Ok(Ok(0)) => break true,
            Ok(Ok(read)) => {
                received.extend_from_slice(&chunk[..read]);
                assert!(received.len() <= PROBE_RESPONSE_BYTES_MAX, "the node keeps sending");
            }
            Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionReset => break false,
            Ok(Err(error)) => panic!("probe read failed: {error}"),
        }
    };
    ProbeOutcome { pdus: decode_all(&received), clean_eof }
}

/// Decodes the controller's PDUs in `bytes`; they must be whole and valid.
fn decode_all(mut bytes: &[u8]) -> Vec<(PduType, Option<(u16, u32)>)> {
    let framing = Framing::new(Role::Host, PDU_SIZE_MAX);
    let mut pdus = Vec::new();
    while !bytes.is_empty() {
        match pdu::decode(bytes, &framing) {
            Ok(Decoded::Pdu { pdu, consumed_bytes }) => {
                let term = match pdu {
                    Pdu::C2HTermReq(term) => Some((term.fes, term.fei)),
                    _ => None,
                };
                pdus.push((pdu.pdu_type(), term));
                bytes = &bytes[consumed_bytes..];
            }
            other => panic!("the node sent a bad or partial PDU: {other:?}: {bytes:02x?}"),
        }
    }
    pdus
}

/// Requires `outcome` to be the expected PDUs (`before`, e.g. an ICResp), then either a
/// C2HTermReq with one of `fes` (and `fei`, if given) followed by a clean close, or just a clean
/// close.
#[track_caller]
fn expect_termination(
    name: &str,
    outcome: &ProbeOutcome,
    before: &[PduType],
    fes: &[FatalErrorStatus],
    fei: Option<u32>,
) {
    let types: Vec<PduType> = outcome.pdus.iter().map(|(pdu_type, _)| *pdu_type).collect();
    assert!(types.starts_with(before), "{name}: expected {before:?} first, got {outcome:?}");
    let rest = &outcome.pdus[before.len()..];
    match rest {
        [] => {}
        [(PduType::C2HTermReq, Some((got_fes, got_fei)))] => {
            assert!(
                fes.iter().any(|want| *want as u16 == *got_fes),
                "{name}: C2HTermReq FES {got_fes:#x}, expected one of {fes:?}"
            );
            if let Some(want) = fei {
                assert_eq!(*got_fei, want, "{name}: C2HTermReq FEI");
            }
        }
        other => panic!("{name}: expected a C2HTermReq or nothing, got {other:?}"),
    }
    assert!(outcome.clean_eof, "{name}: the connection was reset, not closed: {outcome:?}");
    eprintln!("{name}: {:?}, closed", outcome.pdus);
}

fn icreq_bytes(pfv: u16) -> Vec<u8> {
    let mut out = Vec::new();
    pdu::encode_ic_req(
        &mut out,
        &ICReq { pfv, hpda: 0, header_digest: false, data_digest: false, maxr2t: 0 },
    );
    out
}

fn host_framing() -> Framing {
    Framing::new(Role::Host, PDU_SIZE_MAX)
}

fn capsule_bytes(sqe: &Sqe, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    pdu::encode_capsule_cmd(&mut out, &host_framing(), sqe, data);
    out
}

/// A harmless command: Read of block 0 by transport data.
fn read_sqe(cid: u16) -> Sqe {
    Sqe::read(cid, 1, 0, 1).with_sgl(SglDescriptor::transport(BLOCK_BYTES as u32))
}

/// Verified 8 KiB writes and reads in a loop until `stop`; counts iterations in `done`.
async fn healthy_loop(
    mut queue: IoQueue,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> Result<IoQueue, String> {
    let mut iteration: u64 = 0;
    while !stop.load(Ordering::Acquire) {
        let lba = (iteration % HEALTHY_SLOTS) * HEALTHY_BLOCKS_PER_IO as u64;
        let tag = 0x4EA1_0000 + iteration;
        let written = pattern(lba, HEALTHY_BLOCKS_PER_IO, tag);
        let buffer = queue
            .write(lba, written)
            .await
            .map_err(|error| format!("healthy write {iteration} failed: {error}"))?;
        let read = queue
            .read(lba, buffer)
            .await
            .map_err(|error| format!("healthy read {iteration} failed: {error}"))?;
        if let Some(mismatch) = pattern_mismatch(&read, lba, tag) {
            return Err(format!("healthy read {iteration} returned wrong data: {mismatch}"));
        }
        iteration += 1;
        done.store(iteration, Ordering::Release);
    }
    Ok(queue)
}

#[track_caller]
fn expect_status(result: Result<AlignedBuf, InitiatorError>, want: Status, what: &str) {
    match result {
        Err(error @ InitiatorError::CommandFailed { .. }) => {
            let status = error.status().expect("a failed command has a status");
            assert!(status.same_code(want), "{what}: status {status:?}, expected {want:?}");
        }
        Err(error) => panic!("{what}: expected status {want:?}, got {error}"),
        Ok(_) => panic!("{what}: succeeded, expected status {want:?}"),
    }
}

#[test]
fn malformed_input_ends_one_connection_and_nothing_else() {
    let dir = tempfile::tempdir().expect("temp dir");
    let node = Node::start(&dir.path().join("data"), free_port());
    ferrite_ok(&node.api_url, &["volume", "create", VOLUME, "--size", "64M"]);
    let address = node.nvme_address();
    let rt = runtime();

    let stderr = rt.block_on(async {
        let controller =
            Controller::connect(&*address, &volume_nqn(VOLUME), ConnectOptions::default())
                .await
                .expect("connect the healthy controller");
        let healthy = controller.open_io_queue(8).await.expect("open the healthy queue");
        let mut checked = controller.open_io_queue(8).await.expect("open a second queue");
        assert_eq!(healthy.namespace().size_blocks, VOLUME_BLOCKS);
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let healthy_task =
            tokio::spawn(healthy_loop(healthy, Arc::clone(&stop), Arc::clone(&done)));

        // Garbage: an unknown PDU type.
        let garbage: Vec<u8> = (0..64u8).map(|byte| byte.wrapping_mul(37) | 0xF0).collect();
        let outcome = probe(&address, &garbage, false).await;
        expect_termination(
            "garbage",
            &outcome,
            &[],
            &[FatalErrorStatus::InvalidHeaderField],
            Some(0),
        );

        // ICReq with a PDU format version other than 1.0.
        let outcome = probe(&address, &icreq_bytes(PFV_1_0 + 1), false).await;
        expect_termination(
            "ICReq with PFV 1",
            &outcome,
            &[],
            &[FatalErrorStatus::UnsupportedParameter, FatalErrorStatus::InvalidHeaderField],
            None,
        );

        // A truncated ICReq, then the host closes its side.
        let icreq = icreq_bytes(PFV_1_0);
        let outcome = probe(&address, &icreq[..icreq.len() / 2], true).await;
        expect_termination("truncated ICReq then close", &outcome, &[], &[], None);
        assert!(outcome.pdus.is_empty(), "nothing is owed for half a PDU: {outcome:?}");

        // A command capsule before ICReq.
        let outcome = probe(&address, &capsule_bytes(&read_sqe(1), &[]), false).await;
        expect_termination(
            "CapsuleCmd before ICReq",
            &outcome,
            &[],
            &[FatalErrorStatus::PduSequenceError],
            None,
        );

        // After a valid ICReq: a capsule whose PLEN claims far more than the node accepts.
        let mut huge = icreq.clone();
        let mut capsule = capsule_bytes(&read_sqe(1), &[]);
        capsule[4..8].copy_from_slice(&0x7FFF_FFF0u32.to_le_bytes());
        huge.extend_from_slice(&capsule);
        let outcome = probe(&address, &huge, false).await;
        expect_termination(
            "PLEN 2 GiB",
            &outcome,
            &[PduType::ICResp],
            &[FatalErrorStatus::InvalidHeaderField, FatalErrorStatus::DataTransferLimitExceeded],
            None,
        );

        // After a valid ICReq: a capsule with a wrong HLEN.
        let mut bad_hlen = icreq.clone();
        let mut capsule = capsule_bytes(&read_sqe(1), &[]);
        capsule[2] = 0x20;
        bad_hlen.extend_from_slice(&capsule);
        let outcome = probe(&address, &bad_hlen, false).await;
        expect_termination(
            "CapsuleCmd HLEN 32",
            &outcome,
            &[PduType::ICResp],
            &[FatalErrorStatus::InvalidHeaderField],
            Some(2),
        );

        // A second ICReq.
        let twice = [icreq.clone(), icreq.clone()].concat();
        let outcome = probe(&address, &twice, false).await;
        expect_termination(
            "second ICReq",
            &outcome,
            &[PduType::ICResp],
            &[FatalErrorStatus::PduSequenceError],
            None,
        );

        // Out-of-range LBAs through the initiator: an NVMe status, not a disconnect.
        let lba_out_of_range = Status::LBA_OUT_OF_RANGE;
        assert_eq!(
            (lba_out_of_range.status_code_type(), lba_out_of_range.status_code()),
            (0, 0x80)
        );
        let one_block = || AlignedBuf::new(BLOCK_BYTES);
        expect_status(
            checked.read(VOLUME_BLOCKS, one_block()).await,
            lba_out_of_range,
            "Read at the first LBA past the end",
        );
        expect_status(
            checked.write(VOLUME_BLOCKS, pattern(VOLUME_BLOCKS, 1, 1)).await,
            lba_out_of_range,
            "Write at the first LBA past the end",
        );
        expect_status(
            checked.write(VOLUME_BLOCKS - 1, pattern(VOLUME_BLOCKS - 1, 2, 1)).await,
            lba_out_of_range,
            "Write across the end",
        );
        expect_status(
            checked.read(u64::MAX, one_block()).await,
            lba_out_of_range,
            "Read at LBA 2^64-1",
        );
        // The queue still works, up to the last block.
        let last = VOLUME_BLOCKS - 1;
        checked.write(last, pattern(last, 1, 7)).await.expect("write the last block");
        let read = checked.read(last, one_block()).await.expect("read the last block");
        assert_eq!(pattern_mismatch(&read, last, 7), None);

        raw_io_queue_limits(&address, &controller).await;

        // The healthy connection kept working through all of this.
        let before = done.load(Ordering::Acquire);
        let deadline = Instant::now() + HEALTHY_PROGRESS_TIMEOUT;
        while done.load(Ordering::Acquire) < before + HEALTHY_PROGRESS_MIN {
            assert!(
                !healthy_task.is_finished(),
                "the healthy connection stopped: {:?}",
                healthy_task.await
            );
            assert!(Instant::now() < deadline, "the healthy connection made no progress");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.store(true, Ordering::Release);
        let healthy = healthy_task.await.expect("healthy task").expect("healthy I/O");
        eprintln!("healthy loop: {} verified write+read pairs", done.load(Ordering::Acquire));
        assert!(controller.keep_alive_error().is_none(), "{:?}", controller.keep_alive_error());
        drop((healthy, checked));

        // The REST API still answers and the node still serves new connections.
        let list = ferrite_ok(&node.api_url, &["volume", "list"]);
        assert!(list.contains(VOLUME), "{list}");
        controller.shutdown().await.expect("shut the healthy controller down");
        let again = Controller::connect(&*address, &volume_nqn(VOLUME), ConnectOptions::default())
            .await
            .expect("a new connection after the bad ones");
        let mut queue = again.open_io_queue(4).await.expect("open a queue");
        let read = queue.read(last, one_block()).await.expect("read the last block again");
        assert_eq!(pattern_mismatch(&read, last, 7), None);
        drop(queue);
        again.shutdown().await.expect("shut down");
        node.stderr_now()
    });
    // A node that crashed would fail here: SIGTERM must find it running and stop it cleanly.
    let full_stderr = node.stop_cleanly();
    assert!(full_stderr.starts_with(&stderr));
    assert_no_error_lines(&full_stderr, &[], "node fed malformed input");
}

/// A raw I/O queue of the healthy controller: a Read and a Write above MDTS, in-capsule data
/// above the in-capsule limit; each must fail with a status (or end the connection cleanly),
/// and a valid Read afterwards must work.
async fn raw_io_queue_limits(address: &str, controller: &Controller) {
    let framing = host_framing();
    let mut stream = TcpStream::connect(address).await.expect("connect the raw queue");
    let mut buffer = Vec::new();
    stream.write_all(&icreq_bytes(PFV_1_0)).await.expect("send ICReq");
    let icresp = next_pdu(&mut stream, &mut buffer).await.expect("ICResp");
    assert_eq!(icresp.0, PduType::ICResp);

    // Connect as one more I/O queue of the healthy controller (same host identity).
    let host = initiator::default_host();
    let connect_data = ConnectData {
        host_id: host.host_id,
        cntlid: controller.cntlid(),
        subnqn: volume_nqn(VOLUME),
        hostnqn: host.nqn.clone(),
    };
    let mut data = Vec::with_capacity(CONNECT_DATA_BYTES);
    connect_data.encode(&mut data);
    let qid = controller.io_queues_allowed();
    let sqe = Sqe::connect(0, qid, 15, 0)
        .with_sgl(SglDescriptor::in_capsule(0, CONNECT_DATA_BYTES as u32));
    let mut out = Vec::new();
    pdu::encode_capsule_cmd(&mut out, &framing, &sqe, &data);
    stream.write_all(&out).await.expect("send Connect");
    let (pdu_type, status) = next_pdu(&mut stream, &mut buffer).await.expect("Connect response");
    assert_eq!(pdu_type, PduType::CapsuleResp);
    assert!(status.is_some_and(Status::is_success), "raw Connect (qid {qid}) failed: {status:?}");

    let oversize_bytes = 2 * TRANSFER_BYTES_MAX;
    let oversize_blocks = oversize_bytes / BLOCK_BYTES as u32;
    let in_capsule_bytes = 2 * IN_CAPSULE_DATA_BYTES_MAX as usize;
    let commands: [(&str, Sqe, Vec<u8>); 3] = [
        (
            "Read above MDTS",
            Sqe::read(1, 1, 0, oversize_blocks).with_sgl(SglDescriptor::transport(oversize_bytes)),
            Vec::new(),
        ),
        (
            "Write above MDTS",
            Sqe::write(2, 1, 0, oversize_blocks).with_sgl(SglDescriptor::transport(oversize_bytes)),
            Vec::new(),
        ),
        (
            "Write with in-capsule data above the limit",
            Sqe::write(3, 1, 0, (in_capsule_bytes / BLOCK_BYTES) as u32)
                .with_sgl(SglDescriptor::in_capsule(0, in_capsule_bytes as u32)),
            vec![0xA5; in_capsule_bytes],
        ),
    ];
    for (what, sqe, data) in commands {
        stream.write_all(&capsule_bytes(&sqe, &data)).await.expect("send a command");
        match next_pdu(&mut stream, &mut buffer).await {
            Some((PduType::CapsuleResp, Some(status))) => {
                assert!(!status.is_success(), "{what} succeeded");
                eprintln!("{what}: status {status:?}");
            }
            Some((PduType::C2HTermReq, _)) => {
                assert!(next_pdu(&mut stream, &mut buffer).await.is_none(), "{what}: no close");
                eprintln!("{what}: connection terminated");
                return;
            }
            None => {
                eprintln!("{what}: connection closed");
                return;
            }
            Some(other) => panic!("{what}: unexpected answer {other:?}"),
        }
    }
    // The raw queue still serves a valid command.
    stream.write_all(&capsule_bytes(&read_sqe(9), &[])).await.expect("send a Read");
    let (pdu_type, _) = next_pdu(&mut stream, &mut buffer).await.expect("Read data");
    assert_eq!(pdu_type, PduType::C2HData, "a valid Read after the refused ones");
}

/// Reads the next PDU from a raw connection: its type and, for a CapsuleResp, its status.
/// `None` if the node closed the connection.
async fn next_pdu(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
) -> Option<(PduType, Option<Status>)> {
    let framing = host_framing();
    let deadline = Instant::now() + PROBE_TIMEOUT;
    loop {
        if !buffer.is_empty() {
            match pdu::decode(buffer, &framing) {
                Ok(Decoded::Pdu { pdu, consumed_bytes }) => {
                    let status = match pdu {
                        Pdu::CapsuleResp(cqe) => Some(cqe.status),
                        _ => None,
                    };
                    let pdu_type = pdu.pdu_type();
                    buffer.drain(..consumed_bytes);
                    return Some((pdu_type, status));
                }
                Ok(Decoded::Incomplete { .. }) => {}
                other => panic!("the node sent a bad PDU: {other:?}"),
            }
        }
        let mut chunk = vec![0u8; 64 * 1024];
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut chunk)).await {
            Err(_) => panic!("no answer on the raw queue within {PROBE_TIMEOUT:?}"),
            Ok(Ok(0)) => {
                assert!(buffer.is_empty(), "the node closed in the middle of a PDU");
                return None;
            }
            Ok(Ok(read)) => buffer.extend_from_slice(&chunk[..read]),
            Ok(Err(error)) => panic!("raw queue read failed: {error}"),
        }
    }
}
