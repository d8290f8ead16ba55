//! The initiator against `nvmf`'s sans-IO target, served with a RAM disk behind it by the
//! `initiator::testing::RamTarget` fixture: bring-up, data in both directions (in-capsule, R2T,
//! split transfers), the other I/O commands, discovery, several queues at once, keep-alive, and
//! failures.

use std::time::{Duration, Instant};

use initiator::testing::{RamTarget, RamTargetOptions};
use initiator::{
    discover, AlignedBuf, ConnectOptions, Controller, InitiatorError, IoQueue, LbaRange, Nqn,
    Status,
};
use tokio::net::TcpListener;

const BLOCK_BYTES: usize = 4096;
const DISK_BLOCKS: u64 = 4096; // 16 MiB
/// Every test finishes well within this; a hang fails the test instead of stalling the suite.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The server checks keep-alive expiry at least this often.
const SERVER_TICK: Duration = Duration::from_millis(100);

fn subsystem() -> Nqn {
    Nqn::new("nqn.2024-01.io.ferrite:vol:test").unwrap()
}

async fn start_server() -> RamTarget {
    RamTarget::start(RamTargetOptions {
        subnqn: subsystem(),
        ports: 1,
        size_blocks: DISK_BLOCKS,
        block_size_bytes: BLOCK_BYTES as u32,
        serial_number: "test-serial".into(),
        tick: SERVER_TICK,
    })
    .await
}

/// A buffer of `blocks` blocks filled with a pattern that differs per `seed` and per byte.
fn pattern(blocks: usize, seed: u64) -> AlignedBuf {
    let mut buffer = AlignedBuf::new(blocks * BLOCK_BYTES);
    buffer.set_len(blocks * BLOCK_BYTES);
    for (index, byte) in buffer.iter_mut().enumerate() {
        *byte = (index as u64).wrapping_mul(31).wrapping_add(seed.wrapping_mul(131)) as u8
            ^ (index >> 12) as u8;
    }
    buffer
}

fn empty(blocks: usize) -> AlignedBuf {
    let mut buffer = AlignedBuf::new(blocks * BLOCK_BYTES);
    buffer.set_len(blocks * BLOCK_BYTES);
    buffer
}

async fn connect(server: &RamTarget) -> Controller {
    Controller::connect(server.address(), &subsystem(), ConnectOptions::default()).await.unwrap()
}

async fn with_timeout<F: std::future::Future>(future: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, future).await.expect("the test hung")
}

#[tokio::test]
async fn connect_identify_and_shutdown() {
    with_timeout(async {
        let server = start_server().await;
        let controller = Controller::connect(
            server.address().to_string().as_str(),
            &subsystem(),
            ConnectOptions::default(),
        )
        .await
        .unwrap();
        let identify = controller.identify_controller();
        assert_eq!(identify.subnqn, subsystem().as_str());
        assert_eq!(identify.serial_number, "test-serial");
        assert_eq!(identify.model_number, "Ferrite");
        assert_eq!(identify.cntlid, controller.cntlid());
        assert_eq!(identify.nn, 1);
        assert_eq!(identify.mdts, 8);
        assert_eq!(controller.transfer_bytes_max(), 1 << 20);
        assert_eq!(controller.in_capsule_bytes_max(), 8192);
        assert_eq!(controller.queue_depth_max(), 128);
        assert_eq!(controller.io_queues_allowed(), 64);
        let namespace = *controller.namespace().unwrap();
        assert_eq!(
            (namespace.nsid, namespace.size_blocks, namespace.lba_size_bytes),
            (1, DISK_BLOCKS, 4096)
        );
        assert_eq!(namespace.size_bytes(), DISK_BLOCKS * 4096);
        assert_eq!(controller.active_namespaces().await.unwrap(), vec![1]);
        assert_eq!(controller.identify_namespace(1).await.unwrap(), namespace);
        let error = controller.identify_namespace(2).await.unwrap_err();
        assert_eq!(error.status().map(|status| status.status_code()), Some(0x0B), "{error}");
        controller.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn read_write_in_capsule_r2t_and_split() {
    with_timeout(async {
        let server = start_server().await;
        let controller = connect(&server).await;
        let mut queue = controller.open_io_queue(32).await.unwrap();
        assert_eq!(queue.qid(), 1);
        assert_eq!(queue.size_bytes(), DISK_BLOCKS * 4096);

        // 4 KiB: in the capsule. 128 KiB: by R2T. 3 MiB: three 1 MiB commands.
        for (lba, blocks, seed) in [(3u64, 1usize, 1u64), (100, 32, 2), (1000, 768, 3)] {
            let written = pattern(blocks, seed);
            let expected = written.to_vec();
            let returned = queue.write(lba, written).await.unwrap();
            assert_eq!(&returned[..], &expected[..], "the write buffer comes back unchanged");
            let start = lba as usize * BLOCK_BYTES;
            assert_eq!(&server.disk()[start..start + expected.len()], &expected[..]);
            let read = queue.read(lba, empty(blocks)).await.unwrap();
            assert!(read[..] == expected[..], "read back {blocks} blocks at {lba}");
        }

        let error = queue.read(DISK_BLOCKS, empty(1)).await.unwrap_err();
        assert!(
            error.status().is_some_and(|status| status.same_code(Status::LBA_OUT_OF_RANGE)),
            "{error}"
        );
        assert!(error.to_string().contains("LBA Out of Range"), "{error}");
        // The queue goes on after a failed command.
        queue.flush().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn flush_write_zeroes_and_deallocate() {
    with_timeout(async {
        let server = start_server().await;
        let controller = connect(&server).await;
        let mut queue = controller.open_io_queue(8).await.unwrap();
        queue.write(10, pattern(20, 9)).await.unwrap();
        queue.flush().await.unwrap();

        queue.write_zeroes(12, 4).await.unwrap();
        let read = queue.read(10, empty(20)).await.unwrap();
        let expected = pattern(20, 9);
        assert_eq!(&read[..2 * BLOCK_BYTES], &expected[..2 * BLOCK_BYTES]);
        assert!(read[2 * BLOCK_BYTES..6 * BLOCK_BYTES].iter().all(|byte| *byte == 0));
        assert_eq!(&read[6 * BLOCK_BYTES..], &expected[6 * BLOCK_BYTES..]);

        queue
            .deallocate(&[LbaRange { lba: 10, blocks: 1 }, LbaRange { lba: 25, blocks: 5 }])
            .await
            .unwrap();
        let read = queue.read(10, empty(20)).await.unwrap();
        assert!(read[..BLOCK_BYTES].iter().all(|byte| *byte == 0));
        assert_eq!(&read[BLOCK_BYTES..2 * BLOCK_BYTES], &expected[BLOCK_BYTES..2 * BLOCK_BYTES]);
        assert!(read[15 * BLOCK_BYTES..].iter().all(|byte| *byte == 0));
        assert_eq!(
            &read[6 * BLOCK_BYTES..15 * BLOCK_BYTES],
            &expected[6 * BLOCK_BYTES..15 * BLOCK_BYTES]
        );

        // Write Zeroes longer than one command's 65536 blocks is split.
        let error = queue.write_zeroes(0, DISK_BLOCKS + 1).await.unwrap_err();
        assert!(
            error.status().is_some_and(|status| status.same_code(Status::LBA_OUT_OF_RANGE)),
            "{error}"
        );
        assert!(queue.submit_write_zeroes(0, 0, 65537).is_err());
    })
    .await
}

#[tokio::test]
async fn a_queue_of_depth_one_connects_and_works() {
    // SQSIZE is 0's based with a minimum of 1: a depth-1 queue must still be accepted.
    let server = start_server().await;
    with_timeout(async {
        let controller = connect(&server).await;
        let mut queue = controller.open_io_queue(1).await.unwrap();
        let written = queue.write(3, pattern(1, 77)).await.unwrap();
        let read = queue.read(3, empty(1)).await.unwrap();
        assert_eq!(&read[..], &written[..]);
    })
    .await;
}

#[tokio::test]
async fn pipelined_submit_and_poll() {
    with_timeout(async {
        let server = start_server().await;
        let controller = connect(&server).await;
        let depth = 32u16;
        let mut queue = controller.open_io_queue(depth).await.unwrap();
        // Writes of 1, 2, 4 and 8 blocks (in the capsule and by R2T), all in flight at once.
        let blocks_of = |tag: u16| 1usize << (tag % 4);
        for tag in 0..depth {
            queue
                .submit_write(tag, u64::from(tag) * 8, pattern(blocks_of(tag), u64::from(tag)))
                .unwrap();
        }
        assert!(queue.submit_flush(depth).is_err(), "a tag beyond the depth is refused");
        assert!(queue.submit_flush(0).is_err(), "a tag in flight is refused");
        let mut seen = vec![false; usize::from(depth)];
        for _ in 0..depth {
            let completion = queue.next_completion().await.unwrap();
            assert!(completion.status.is_success());
            let tag = completion.tag;
            assert!(!seen[usize::from(tag)], "tag {tag} completed twice");
            seen[usize::from(tag)] = true;
            assert_eq!(completion.buffer.unwrap().len(), blocks_of(tag) * BLOCK_BYTES);
        }
        assert_eq!(queue.outstanding(), 0);
        assert!(queue.next_completion().await.is_err(), "nothing in flight");
        for tag in 0..depth {
            queue.submit_read(tag, u64::from(tag) * 8, empty(blocks_of(tag))).unwrap();
        }
        for _ in 0..depth {
            let completion = queue.next_completion().await.unwrap();
            let buffer = completion.buffer.unwrap();
            assert!(
                buffer[..] == pattern(blocks_of(completion.tag), u64::from(completion.tag))[..]
            );
        }
    })
    .await
}

#[tokio::test]
async fn several_io_queues_at_once_with_digests() {
    with_timeout(async {
        let server = start_server().await;
        let options =
            ConnectOptions { header_digest: true, data_digest: true, ..ConnectOptions::default() };
        let controller =
            Controller::connect(server.address(), &subsystem(), options).await.unwrap();
        let mut queues = Vec::new();
        for _ in 0..4 {
            queues.push(controller.open_io_queue(16).await.unwrap());
        }
        let qids: Vec<u16> = queues.iter().map(IoQueue::qid).collect();
        assert_eq!(qids, [1, 2, 3, 4]);
        let work = queues.into_iter().enumerate().map(|(index, mut queue)| async move {
            let base = index as u64 * 512;
            for round in 0..8u64 {
                for tag in 0..16u16 {
                    let lba = base + u64::from(tag) * 4;
                    queue
                        .submit_write(tag, lba, pattern(4, base + round + u64::from(tag)))
                        .unwrap();
                }
                for _ in 0..16 {
                    assert!(queue.next_completion().await.unwrap().status.is_success());
                }
            }
            for tag in 0..16u16 {
                let lba = base + u64::from(tag) * 4;
                let read = queue.read(lba, empty(4)).await.unwrap();
                assert!(
                    read[..] == pattern(4, base + 7 + u64::from(tag))[..],
                    "queue {index} tag {tag}"
                );
            }
        });
        let tasks: Vec<_> = work.map(tokio::spawn).collect();
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await
}

#[tokio::test]
async fn discovery_log_lists_the_subsystem() {
    with_timeout(async {
        let server = start_server().await;
        let entries = discover(server.address(), &initiator::default_host().nqn).await.unwrap();
        let nqns: Vec<&str> = entries.iter().map(|entry| entry.subnqn.as_str()).collect();
        assert_eq!(nqns, [types_discovery_nqn(), subsystem().as_str()]);
        let entry = &entries[1];
        assert_eq!(entry.trtype, nvmf::structures::trtype::TCP);
        assert_eq!(entry.subtype, nvmf::structures::subtype::NVM);
        assert_eq!(entry.traddr, "127.0.0.1");
        assert_eq!(entry.trsvcid, server.address().port().to_string());
    })
    .await
}

fn types_discovery_nqn() -> &'static str {
    "nqn.2014-08.org.nvmexpress.discovery"
}

#[tokio::test]
async fn keep_alive_keeps_the_controller() {
    with_timeout(async {
        let server = start_server().await;
        // The target rounds KATO up to its 1 s granularity; the host sends every 500 ms.
        let options = ConnectOptions {
            keep_alive_timeout: Duration::from_secs(1),
            ..ConnectOptions::default()
        };
        let controller =
            Controller::connect(server.address(), &subsystem(), options).await.unwrap();
        let mut queue = controller.open_io_queue(4).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        queue.write(0, pattern(1, 5)).await.unwrap();
        assert!(!server.keep_alive_expired());
        assert_eq!(controller.keep_alive_error(), None);
    })
    .await
}

#[tokio::test]
async fn unknown_subsystem_is_a_clear_error() {
    with_timeout(async {
        let server = start_server().await;
        let unknown = Nqn::new("nqn.2024-01.io.ferrite:vol:nope").unwrap();
        let error = Controller::connect(server.address(), &unknown, ConnectOptions::default())
            .await
            .unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, InitiatorError::ConnectRejected { .. }), "{message}");
        assert!(
            message.contains("rejected Connect for nqn.2024-01.io.ferrite:vol:nope"),
            "{message}"
        );
        assert!(message.contains("(Connect Invalid Parameters)"), "{message}");
        assert!(message.contains("no such subsystem"), "{message}");
    })
    .await
}

#[tokio::test]
async fn refused_connection_says_what_to_do() {
    with_timeout(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        drop(listener);
        let error = Controller::connect(address, &subsystem(), ConnectOptions::default())
            .await
            .unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, InitiatorError::ConnectRefused { .. }), "{message}");
        assert!(
            message.contains(&format!("connect to {address} refused: is `ferrite up` running")),
            "{message}"
        );
    })
    .await
}

#[tokio::test]
async fn server_closing_mid_command_is_an_error_not_a_hang() {
    with_timeout(async {
        let server = start_server().await;
        let controller = connect(&server).await;
        let mut queue = controller.open_io_queue(4).await.unwrap();
        queue.write(40, pattern(1, 1)).await.unwrap();
        server.close_on_read(40);
        let error = queue.read(40, empty(1)).await.unwrap_err();
        assert!(matches!(error, InitiatorError::ConnectionClosed { qid: 1, .. }), "{error}");
        // The queue stays broken, with the reason.
        let again = queue.flush().await.unwrap_err();
        assert!(matches!(again, InitiatorError::QueueBroken { .. }), "{again}");
        assert!(again.to_string().contains("closed the connection"), "{again}");
        // Other queues of the controller are unaffected.
        let mut other = controller.open_io_queue(4).await.unwrap();
        other.flush().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn silent_server_times_out() {
    with_timeout(async {
        // Accepts the TCP connection and never answers the ICReq.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let holder = tokio::spawn(async move {
            let (_stream, _) = listener.accept().await.unwrap();
            tokio::time::sleep(TEST_TIMEOUT).await;
        });
        let options = ConnectOptions {
            connect_timeout: Duration::from_millis(300),
            ..ConnectOptions::default()
        };
        let started = Instant::now();
        let error = Controller::connect(address, &subsystem(), options).await.unwrap_err();
        assert!(matches!(error, InitiatorError::Timeout { .. }), "{error}");
        assert!(error.to_string().contains("within 300 ms"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(5));
        holder.abort();
    })
    .await
}
