//! Asynchronous events against `nvmf`'s target (the `initiator::testing::RamTarget` fixture):
//! the host keeps an Asynchronous Event Request outstanding on every controller, learns ANA
//! changes and namespace resizes from the notices without any I/O failing, moves multipath I/O to
//! the new optimized path, and still runs every other admin command, shuts down and disconnects
//! promptly with the request outstanding.

use std::time::{Duration, Instant};

use initiator::testing::{RamTarget, RamTargetOptions};
use initiator::{
    AnaState, AsyncEventState, ConnectOptions, Controller, InitiatorError, MultipathNamespace, Nqn,
    PathState, ASYNC_EVENT_ANA_CHANGE, ASYNC_EVENT_NAMESPACE_ATTRIBUTE,
};
use nvmf::command::{feature, Sqe};

const BLOCK_BYTES: usize = 4096;
const DISK_BLOCKS: u64 = 1024;
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The target delivers pending notices on its admin connections at least this often.
const SERVER_TICK: Duration = Duration::from_millis(50);
/// A notice reaches the host and is handled well within this.
const NOTICE_TIMEOUT: Duration = Duration::from_secs(10);
/// A shutdown or disconnect with a request outstanding returns well within this.
const PROMPT: Duration = Duration::from_secs(3);
const POLL_INTERVAL: Duration = Duration::from_millis(10);

fn subsystem() -> Nqn {
    Nqn::new("nqn.2024-01.io.ferrite:vol:events").unwrap()
}

async fn start_server(ports: u16, tick: Duration) -> RamTarget {
    RamTarget::start(RamTargetOptions {
        subnqn: subsystem(),
        ports,
        size_blocks: DISK_BLOCKS,
        block_size_bytes: BLOCK_BYTES as u32,
        serial_number: "events".into(),
        tick,
    })
    .await
}

async fn with_timeout<F: std::future::Future>(future: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, future).await.expect("the test hung")
}

/// Polls `done` until it holds; panics with `what` after [`NOTICE_TIMEOUT`].
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + NOTICE_TIMEOUT;
    while !done() {
        assert!(Instant::now() < deadline, "not within {NOTICE_TIMEOUT:?}: {what}");
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

fn reads(server: &RamTarget) -> [u64; 2] {
    [1, 2].map(|port_id| server.reads_on_port(port_id))
}

fn states(device: &MultipathNamespace) -> Vec<PathState> {
    device.paths().iter().map(|path| path.state).collect()
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..2 * BLOCK_BYTES).map(|index| (index % 251) as u8 ^ seed).collect()
}

#[tokio::test]
async fn ana_change_notice_moves_io_without_an_error() {
    with_timeout(async {
        let server = start_server(2, SERVER_TICK).await;
        server.set_ana_state(2, AnaState::NonOptimized);
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &subsystem(), Default::default(), 8)
                .await
                .unwrap();
        assert_eq!(states(&device), [PathState::Optimized, PathState::NonOptimized]);
        assert_eq!(device.current_path(), Some(0));
        let first = pattern(1);
        device.write(10, &first).await.unwrap();
        assert_eq!(&device.read(10, first.len()).await.unwrap()[..], &first[..]);
        assert_eq!(reads(&server), [1, 0], "I/O goes down the optimized path");

        // The node moves the namespace to port 2. No I/O is issued: only the notices can tell.
        server.set_ana_state(1, AnaState::Inaccessible);
        server.set_ana_state(2, AnaState::Optimized);
        eventually("path 2 becomes current through ANA change notices", || {
            device.current_path() == Some(1)
                && states(&device) == [PathState::Inaccessible, PathState::Optimized]
        })
        .await;
        assert_eq!(reads(&server), [1, 0], "nothing was read while waiting");

        // I/O continues on port 2 at once, without a failed attempt on port 1.
        assert_eq!(&device.read(10, first.len()).await.unwrap()[..], &first[..]);
        let second = pattern(2);
        device.write(20, &second).await.unwrap();
        assert_eq!(&device.read(20, second.len()).await.unwrap()[..], &second[..]);
        assert_eq!(reads(&server), [1, 2]);
        assert_eq!(device.failovers(), 0, "no command failed on a path");

        // And back: port 1 optimized again, port 2 non-optimized.
        server.set_ana_state(1, AnaState::Optimized);
        server.set_ana_state(2, AnaState::NonOptimized);
        eventually("path 1 becomes current again", || {
            device.current_path() == Some(0)
                && states(&device) == [PathState::Optimized, PathState::NonOptimized]
        })
        .await;
        assert_eq!(&device.read(20, second.len()).await.unwrap()[..], &second[..]);
        assert_eq!(reads(&server), [2, 2]);

        // Persistent loss and change are no more usable than inaccessible; the non-optimized
        // path carries the I/O while it is the only one left.
        server.set_ana_state(1, AnaState::PersistentLoss);
        eventually("persistent loss shows", || device.current_path() == Some(1)).await;
        server.set_ana_state(1, AnaState::Change);
        eventually("change shows", || {
            states(&device) == [PathState::Inaccessible, PathState::NonOptimized]
        })
        .await;
        assert_eq!(&device.read(10, first.len()).await.unwrap()[..], &first[..]);
        assert_eq!(reads(&server), [2, 3]);
        assert_eq!(device.failovers(), 0);
    })
    .await;
}

#[tokio::test]
async fn the_controller_publishes_each_ana_notice() {
    with_timeout(async {
        let server = start_server(1, SERVER_TICK).await;
        let controller =
            Controller::connect(server.address(), &subsystem(), ConnectOptions::default())
                .await
                .unwrap();
        // Linux's nvme_enable_aen: the notices the controller offers, among those handled.
        let sqe = Sqe::get_features(0, feature::ASYNC_EVENT_CONFIGURATION, 0);
        let completion = controller.admin_command(sqe, None, "Get Features AEC").await.unwrap();
        assert_eq!(
            completion.result as u32,
            ASYNC_EVENT_NAMESPACE_ATTRIBUTE | ASYNC_EVENT_ANA_CHANGE
        );
        let before: AsyncEventState = controller.async_events();
        assert_eq!(before.requests_outstanding, 1);
        assert_eq!(before.notices, 0);
        assert_eq!(controller.ana_state(1), AnaState::Optimized);
        assert_eq!(controller.ana_states().len(), 1);

        let mut watcher = controller.watch_async_events();
        watcher.borrow_and_update();
        server.set_ana_state(1, AnaState::Inaccessible);
        tokio::time::timeout(NOTICE_TIMEOUT, watcher.wait_for(|state| state.notices == 1))
            .await
            .expect("the notice arrives")
            .unwrap();
        eventually("the ANA log is read", || controller.ana_state(1) == AnaState::Inaccessible)
            .await;
        let after = controller.async_events();
        assert!(after.generation > before.generation);
        assert!(after.ana_change_count > before.ana_change_count);
        // The request was submitted again: a second change is reported too.
        eventually("re-armed", || controller.async_events().requests_outstanding == 1).await;
        server.set_ana_state(1, AnaState::NonOptimized);
        eventually("the second notice", || {
            controller.ana_state(1) == AnaState::NonOptimized
                && controller.async_events().notices == 2
        })
        .await;
        assert_eq!(controller.async_events().stopped, None);
    })
    .await;
}

#[tokio::test]
async fn io_on_a_path_made_inaccessible_is_retried_on_another() {
    with_timeout(async {
        // A slow tick holds the notice back, so the I/O meets the new state first.
        let server = start_server(2, Duration::from_secs(2)).await;
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &subsystem(), Default::default(), 8)
                .await
                .unwrap();
        let data = pattern(3);
        device.write(30, &data).await.unwrap();
        assert_eq!(device.current_path(), Some(0));
        server.set_ana_state(1, AnaState::Inaccessible);
        assert_eq!(&device.read(30, data.len()).await.unwrap()[..], &data[..]);
        assert_eq!(device.failovers(), 1, "the read failed on path 1 with an ANA status");
        assert_eq!(device.current_path(), Some(1));
        assert_eq!(reads(&server), [0, 1]);
    })
    .await;
}

#[tokio::test]
async fn a_resize_notice_changes_the_reported_size() {
    with_timeout(async {
        let server = start_server(2, SERVER_TICK).await;
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &subsystem(), Default::default(), 8)
                .await
                .unwrap();
        let controller =
            Controller::connect(server.address(), &subsystem(), ConnectOptions::default())
                .await
                .unwrap();
        let mut queue = controller.open_io_queue(4).await.unwrap();
        assert_eq!(device.size_blocks(), DISK_BLOCKS);
        assert_eq!(controller.current_namespace().unwrap().size_blocks, DISK_BLOCKS);

        server.resize_namespace(2 * DISK_BLOCKS);
        eventually("the new size is identified", || {
            device.size_blocks() == 2 * DISK_BLOCKS
                && controller
                    .current_namespace()
                    .is_some_and(|ns| ns.size_blocks == 2 * DISK_BLOCKS)
        })
        .await;
        assert_eq!(queue.size_bytes(), 2 * DISK_BLOCKS * BLOCK_BYTES as u64);
        assert_eq!(controller.namespace().unwrap().size_blocks, DISK_BLOCKS, "as at connect");
        assert!(controller.async_events().notices >= 1);

        // The grown space takes I/O through both.
        let data = pattern(4);
        let beyond = DISK_BLOCKS + 100;
        device.write(beyond, &data).await.unwrap();
        assert_eq!(&device.read(beyond, data.len()).await.unwrap()[..], &data[..]);
        let mut buffer = initiator::AlignedBuf::new(BLOCK_BYTES);
        buffer.set_len(BLOCK_BYTES);
        let read = queue.read(beyond, buffer).await.unwrap();
        assert_eq!(&read[..], &data[..BLOCK_BYTES]);

        // A second resize is noticed too (the first notice's log was read, so it is not
        // masked).
        server.resize_namespace(DISK_BLOCKS / 2);
        eventually("the shrink is identified", || {
            device.size_blocks() == DISK_BLOCKS / 2
                && controller
                    .current_namespace()
                    .is_some_and(|ns| ns.size_blocks == DISK_BLOCKS / 2)
        })
        .await;
    })
    .await;
}

#[tokio::test]
async fn an_outstanding_request_blocks_nothing_and_disconnect_is_prompt() {
    with_timeout(async {
        let server = start_server(1, SERVER_TICK).await;
        let connect = || async {
            Controller::connect(server.address(), &subsystem(), ConnectOptions::default())
                .await
                .unwrap()
        };
        let outstanding =
            |controller: &Controller| controller.async_events().requests_outstanding == 1;

        // Admin commands run beside the request, one after another and several at once.
        let controller = connect().await;
        eventually("a request is outstanding", || outstanding(&controller)).await;
        let started = Instant::now();
        for _ in 0..20 {
            controller.identify_namespace(1).await.unwrap();
        }
        let (a, b, c) = tokio::join!(
            controller.active_namespaces(),
            controller.identify_namespace(1),
            controller.active_namespaces()
        );
        assert_eq!(a.unwrap(), [1]);
        assert_eq!(b.unwrap().size_blocks, DISK_BLOCKS);
        assert_eq!(c.unwrap(), [1]);
        assert!(started.elapsed() < PROMPT, "admin commands waited: {:?}", started.elapsed());

        // A clean shutdown returns promptly with the request outstanding.
        let started = Instant::now();
        tokio::time::timeout(PROMPT, controller.shutdown())
            .await
            .expect("the shutdown returns promptly")
            .unwrap();
        assert!(started.elapsed() < PROMPT);

        // Dropping a controller closes its connection although the request is outstanding.
        let controller = connect().await;
        eventually("a request is outstanding", || outstanding(&controller)).await;
        drop(controller);
        eventually("the target sees every controller gone", || {
            server.target().controller_count() == 0
        })
        .await;

        // The target ending the connection ends the request: not submitted again, no panic,
        // and admin commands fail at once instead of hanging.
        let controller = connect().await;
        eventually("a request is outstanding", || outstanding(&controller)).await;
        let hostnqn = controller.host().nqn.clone();
        assert_eq!(server.target().disconnect_host(&subsystem(), &hostnqn), 1);
        eventually("the host notices", || {
            let state = controller.async_events();
            !controller.is_live() && state.requests_outstanding == 0 && state.stopped.is_some()
        })
        .await;
        let started = Instant::now();
        let error = controller.identify_namespace(1).await.unwrap_err();
        assert!(matches!(error, InitiatorError::QueueBroken { qid: 0, .. }), "{error}");
        assert!(started.elapsed() < PROMPT);
        let stopped = controller.async_events().stopped.unwrap();
        assert!(stopped.contains("admin queue stopped"), "{stopped}");
    })
    .await;
}
