//! Multipath against `nvmf`'s target (the `initiator::testing::RamTarget` fixture) exposed on two
//! listeners (two ports of one subsystem, as a node with two listen addresses serves it): the
//! initiator connects a controller on each path, sends I/O down the optimized one, and fails over
//! when the node makes that path inaccessible (ANA, learnt from the notice or from the failed
//! I/O, whichever comes first) or when its connection breaks, as Linux's native multipath does.
//! `async_events.rs` covers the notices themselves.

use std::time::{Duration, Instant};

use initiator::testing::{RamTarget, RamTargetOptions};
use initiator::{
    ConnectOptions, InitiatorError, MultipathNamespace, Nqn, PathState, Status,
    MULTIPATH_FAILOVER_TIMEOUT_DEFAULT, MULTIPATH_IO_TIMEOUT_DEFAULT, MULTIPATH_RECONNECT_INTERVAL,
};
use nvmf::target::AnaState;

const BLOCK_BYTES: usize = 4096;
const DISK_BLOCKS: u64 = 1024;
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The server looks at its cut switch and keep-alive at least this often.
const SERVER_TICK: Duration = Duration::from_millis(50);
/// Short timeouts, so that the tests that wait them out stay quick.
const SHORT_IO_TIMEOUT: Duration = Duration::from_millis(500);
const SHORT_FAILOVER_TIMEOUT: Duration = Duration::from_secs(1);
/// What a wait bounded by one of those timeouts may take beyond it on a busy machine.
const SLACK: Duration = Duration::from_secs(2);

fn subsystem() -> Nqn {
    Nqn::new("nqn.2024-01.io.ferrite:vol:multipath").unwrap()
}

/// The subsystem on two ports (port IDs 1 and 2).
async fn start_server() -> RamTarget {
    RamTarget::start(RamTargetOptions {
        subnqn: subsystem(),
        ports: 2,
        size_blocks: DISK_BLOCKS,
        block_size_bytes: BLOCK_BYTES as u32,
        serial_number: "multipath".into(),
        tick: SERVER_TICK,
    })
    .await
}

/// Reads served through port 1 and port 2.
fn reads(server: &RamTarget) -> [u64; 2] {
    [1, 2].map(|port_id| server.reads_on_port(port_id))
}

async fn with_timeout<F: std::future::Future>(future: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, future).await.expect("the test hung")
}

#[tokio::test]
async fn fails_over_on_ana_change_and_on_a_broken_path() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &nqn, ConnectOptions::default(), 8)
                .await
                .unwrap();
        let paths = device.paths();
        assert_eq!(paths.len(), 2);
        assert!(paths.iter().all(|path| path.state == PathState::Optimized));
        assert_ne!(paths[0].cntlid, paths[1].cntlid, "one controller per path");
        assert_eq!(device.current_path(), Some(0), "the first optimized path");

        let data: Vec<u8> = (0..2 * BLOCK_BYTES).map(|i| (i % 253) as u8).collect();
        device.write(10, &data).await.unwrap();
        assert_eq!(&device.read(10, data.len()).await.unwrap()[..], &data[..]);
        assert_eq!(reads(&server), [1, 0]);

        // The node makes port 1 inaccessible: the next read gets ANA Inaccessible there, the
        // host rereads the ANA logs and the read succeeds on port 2.
        server.target().set_ana_state(&nqn, 1, AnaState::Inaccessible);
        assert_eq!(&device.read(10, data.len()).await.unwrap()[..], &data[..]);
        assert_eq!(reads(&server), [1, 1]);
        assert_eq!(device.current_path(), Some(1));
        assert_eq!(device.paths()[0].state, PathState::Inaccessible);

        // Port 1 optimized again, port 2 non-optimized: a refresh moves I/O back.
        server.target().set_ana_state(&nqn, 1, AnaState::Optimized);
        server.target().set_ana_state(&nqn, 2, AnaState::NonOptimized);
        device.refresh().await.unwrap();
        assert_eq!(device.current_path(), Some(0));
        assert_eq!(device.paths()[1].state, PathState::NonOptimized);
        device.read(10, BLOCK_BYTES).await.unwrap();
        assert_eq!(reads(&server), [2, 1]);

        // Port 1's connections break: the read fails over to the non-optimized path.
        server.set_port_cut(1, true);
        tokio::time::sleep(3 * SERVER_TICK).await;
        assert_eq!(&device.read(10, data.len()).await.unwrap()[..], &data[..]);
        assert_eq!(device.current_path(), Some(1));
        assert_eq!(device.paths()[0].state, PathState::Down);

        // Port 1 comes back: a refresh reconnects it and prefers it again.
        server.set_port_cut(1, false);
        device.refresh().await.unwrap();
        assert_eq!(device.current_path(), Some(0));
        assert_eq!(device.paths()[0].state, PathState::Optimized);

        // A command error that is not about the path is returned, not retried elsewhere.
        let error = device.read(DISK_BLOCKS, BLOCK_BYTES).await.unwrap_err();
        assert!(error.status().is_some_and(|status| status.same_code(Status::LBA_OUT_OF_RANGE)));
        assert_eq!(device.current_path(), Some(0));
    })
    .await;
}

#[tokio::test]
async fn every_path_inaccessible_is_an_error_after_the_failover_timeout() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &nqn, ConnectOptions::default(), 4)
                .await
                .unwrap();
        assert_eq!(device.failover_timeout(), MULTIPATH_FAILOVER_TIMEOUT_DEFAULT);
        device.set_failover_timeout(SHORT_FAILOVER_TIMEOUT);
        server.target().set_ana_state(&nqn, 1, AnaState::Inaccessible);
        server.target().set_ana_state(&nqn, 2, AnaState::PersistentLoss);
        // The ANA change notices tell the host before any I/O is tried.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while device.paths().iter().any(|path| path.state != PathState::Inaccessible) {
            assert!(std::time::Instant::now() < deadline, "{:?}", device.paths());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(device.current_path(), None);
        let started = Instant::now();
        let error = device.read(0, BLOCK_BYTES).await.unwrap_err();
        let waited = started.elapsed();
        assert!(matches!(error, InitiatorError::NoUsablePath { .. }), "{error}");
        assert!(error.to_string().contains("Inaccessible"), "{error}");
        assert!(
            (SHORT_FAILOVER_TIMEOUT..SHORT_FAILOVER_TIMEOUT + SLACK).contains(&waited),
            "gave up after {waited:?}"
        );
        assert_eq!(device.failovers(), 0, "no command was sent down an unusable path");
        assert_eq!(device.current_path(), None);
        // A path that connects but cannot be reached for I/O is not chosen; one that cannot
        // connect at all makes connect fail only when it is the only one.
        let lone = MultipathNamespace::connect(
            &["127.0.0.1:1".to_owned()],
            &nqn,
            ConnectOptions { connect_timeout: Duration::from_millis(500), ..Default::default() },
            4,
        )
        .await;
        assert!(lone.is_err());
    })
    .await;
}

#[tokio::test]
async fn a_path_that_stops_answering_is_abandoned_after_the_io_timeout() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        // Port 2 non-optimized: I/O goes to port 1 while port 1 is up, and back to it after.
        server.set_ana_state(2, AnaState::NonOptimized);
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &nqn, ConnectOptions::default(), 4)
                .await
                .unwrap();
        assert_eq!(device.io_timeout(), MULTIPATH_IO_TIMEOUT_DEFAULT);
        device.set_io_timeout(SHORT_IO_TIMEOUT);
        let data: Vec<u8> = (0..BLOCK_BYTES).map(|i| (i % 249) as u8).collect();
        device.write(40, &data).await.unwrap();
        assert_eq!(reads(&server), [0, 0]);
        assert_eq!(device.current_path(), Some(0));

        // Port 1 stops answering (a stopped node): the read waits out the I/O timeout there,
        // then the path is down and the read is served by port 2.
        server.set_port_stalled(1, true);
        let started = Instant::now();
        assert_eq!(&device.read(40, BLOCK_BYTES).await.unwrap()[..], &data[..]);
        let waited = started.elapsed();
        assert!(
            (SHORT_IO_TIMEOUT..SHORT_IO_TIMEOUT + SLACK).contains(&waited),
            "failed over after {waited:?}"
        );
        assert_eq!(device.failovers(), 1);
        assert_eq!(reads(&server), [0, 1]);
        assert_eq!(device.paths()[0].state, PathState::Down);
        assert_eq!(device.current_path(), Some(1));

        // I/O goes on at once on port 2 while port 1 stays stalled: the down path is not tried
        // again (its reconnection runs in the background and cannot finish).
        let started = Instant::now();
        for round in 0..10u8 {
            let block: Vec<u8> = data.iter().map(|byte| byte ^ round).collect();
            device.write(41, &block).await.unwrap();
            assert_eq!(&device.read(41, BLOCK_BYTES).await.unwrap()[..], &block[..]);
        }
        assert!(started.elapsed() < SHORT_IO_TIMEOUT, "took {:?}", started.elapsed());
        assert_eq!(device.failovers(), 1);
        assert_eq!(reads(&server), [0, 11]);

        // The node resumes: the path is reconnected in the background and, optimized, preferred
        // again, without any I/O failing.
        server.set_port_stalled(1, false);
        let deadline = Instant::now() + TEST_TIMEOUT / 2;
        while device.current_path() != Some(0) {
            assert!(Instant::now() < deadline, "path 1 never came back: {:?}", device.paths());
            device.read(40, BLOCK_BYTES).await.unwrap();
            tokio::time::sleep(SERVER_TICK).await;
        }
        let before = reads(&server)[0];
        assert_eq!(&device.read(40, BLOCK_BYTES).await.unwrap()[..], &data[..]);
        assert_eq!(reads(&server)[0], before + 1, "served by port 1 again");
        assert_eq!(device.failovers(), 1);
    })
    .await;
}

#[tokio::test]
async fn io_rides_through_a_time_without_any_usable_path() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        server.set_ana_state(2, AnaState::Inaccessible);
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &nqn, ConnectOptions::default(), 4)
                .await
                .unwrap();
        device.set_failover_timeout(Duration::from_secs(10));
        let data: Vec<u8> = (0..BLOCK_BYTES).map(|i| (i % 241) as u8).collect();
        device.write(7, &data).await.unwrap();

        // A failover: the old primary's port turns inaccessible, and only a moment later the new
        // primary's turns optimized. The read issued in between waits for it.
        server.set_ana_state(1, AnaState::Inaccessible);
        let gap = Duration::from_millis(700);
        let promote = {
            let target = std::sync::Arc::clone(server.target());
            let nqn = nqn.clone();
            tokio::spawn(async move {
                tokio::time::sleep(gap).await;
                target.set_ana_state(&nqn, 2, AnaState::Optimized);
            })
        };
        let started = Instant::now();
        assert_eq!(&device.read(7, BLOCK_BYTES).await.unwrap()[..], &data[..]);
        let waited = started.elapsed();
        promote.await.unwrap();
        assert!((gap / 2..gap + SLACK).contains(&waited), "waited {waited:?}");
        assert_eq!(device.current_path(), Some(1));
        assert_eq!(reads(&server), [0, 1]);
    })
    .await;
}

#[tokio::test]
async fn a_down_path_is_reconnected_at_a_bounded_rate() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &nqn, ConnectOptions::default(), 4)
                .await
                .unwrap();
        // Port 1 refuses service: every connection is dropped as soon as it is accepted.
        server.set_port_cut(1, true);
        tokio::time::sleep(3 * SERVER_TICK).await;
        let before = server.connections_on_port(1);
        let started = Instant::now();
        let mut rounds = 0u64;
        while started.elapsed() < 4 * MULTIPATH_RECONNECT_INTERVAL {
            device.write(rounds % 16, &[rounds as u8; BLOCK_BYTES]).await.unwrap();
            rounds += 1;
        }
        let attempts = server.connections_on_port(1) - before;
        let elapsed = started.elapsed();
        let allowed = elapsed.as_millis() / MULTIPATH_RECONNECT_INTERVAL.as_millis() + 1;
        assert!(rounds > 20, "I/O went on meanwhile ({rounds} writes)");
        assert_eq!(device.paths()[0].state, PathState::Down);
        // Each attempt is one connection (its admin queue; it never gets further).
        assert!(
            (2..=allowed as u64).contains(&attempts),
            "{attempts} reconnections in {elapsed:?}, at most {allowed} allowed"
        );
    })
    .await;
}

#[tokio::test]
async fn a_command_dropped_half_way_resets_its_path() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        server.set_ana_state(2, AnaState::NonOptimized);
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &nqn, ConnectOptions::default(), 1)
                .await
                .unwrap();
        let data = vec![0x5A; BLOCK_BYTES];
        device.write(3, &data).await.unwrap();
        server.set_port_stalled(1, true);
        // The caller gives up on a read long before the I/O timeout.
        let abandoned = tokio::time::timeout(SHORT_IO_TIMEOUT, device.read(3, BLOCK_BYTES)).await;
        assert!(abandoned.is_err(), "the stalled read cannot complete");
        // The next command does not reuse the queue that still holds it: path 1 is reset and
        // the read is served by port 2 at once, with no I/O timeout to wait out.
        let started = Instant::now();
        assert_eq!(&device.read(3, BLOCK_BYTES).await.unwrap()[..], &data[..]);
        assert!(started.elapsed() < SHORT_IO_TIMEOUT, "took {:?}", started.elapsed());
        assert_eq!(device.paths()[0].state, PathState::Down);
        assert_eq!(reads(&server), [0, 1]);
        assert_eq!(device.failovers(), 0, "no command failed on a path");
    })
    .await;
}
