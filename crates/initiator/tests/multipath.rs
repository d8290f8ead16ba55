//! Multipath against `nvmf`'s target (the `initiator::testing::RamTarget` fixture) exposed on two
//! listeners (two ports of one subsystem, as a node with two listen addresses serves it): the
//! initiator connects a controller on each path, sends I/O down the optimized one, and fails over
//! when the node makes that path inaccessible (ANA, learnt from the notice or from the failed
//! I/O, whichever comes first) or when its connection breaks, as Linux's native multipath does.
//! `async_events.rs` covers the notices themselves.

use std::time::Duration;

use initiator::testing::{RamTarget, RamTargetOptions};
use initiator::{ConnectOptions, InitiatorError, MultipathNamespace, Nqn, PathState, Status};
use nvmf::target::AnaState;

const BLOCK_BYTES: usize = 4096;
const DISK_BLOCKS: u64 = 1024;
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The server looks at its cut switch and keep-alive at least this often.
const SERVER_TICK: Duration = Duration::from_millis(50);

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
async fn every_path_inaccessible_is_an_error_after_bounded_retries() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        let mut device =
            MultipathNamespace::connect(&server.addresses(), &nqn, ConnectOptions::default(), 4)
                .await
                .unwrap();
        server.target().set_ana_state(&nqn, 1, AnaState::Inaccessible);
        server.target().set_ana_state(&nqn, 2, AnaState::PersistentLoss);
        // The ANA change notices tell the host before any I/O is tried.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while device.paths().iter().any(|path| path.state != PathState::Inaccessible) {
            assert!(std::time::Instant::now() < deadline, "{:?}", device.paths());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(device.current_path(), None);
        let error = device.read(0, BLOCK_BYTES).await.unwrap_err();
        assert!(matches!(error, InitiatorError::NoUsablePath { .. }), "{error}");
        assert!(error.to_string().contains("Inaccessible"), "{error}");
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
