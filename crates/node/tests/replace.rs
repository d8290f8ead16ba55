//! Drive replacement on a memory-backed node, in process: the replacement is a new memory
//! drive, the rebuild runs to its end, and the API reports each step. (Drive files and data
//! surviving failures are covered end to end by the cli crate's tests/erasure.rs.)

use node::{DriveBackend, Node, NodeConfig};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const REBUILD_TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn a_memory_drive_is_replaced_and_rebuilt() {
    let config = NodeConfig {
        drive_count: Some(3),
        drive_size_bytes: Some(64 * MIB),
        nvme_listen: vec!["127.0.0.1:0".parse().unwrap()],
        nbd_listen: None,
        api_listen: "127.0.0.1:0".parse().unwrap(),
        data_threads: 2,
        scrub_mb_per_s: 0,
        ..NodeConfig::default()
    };
    let node = Node::start_on(config, DriveBackend::Memory).unwrap();
    assert_eq!(node.erasure().to_string(), "2+1", "the default on 3 drives");
    let client = api::Client::new(&node.api_url()).unwrap();
    let error = client.replace_drive(1, Some("/dev/null")).unwrap_err();
    assert_eq!(error.code(), Some(api::ErrorCode::InvalidDrive), "{error}");

    let drive = client.replace_drive(1, None).unwrap();
    assert_eq!(drive.index, 1);
    assert_eq!(drive.state, api::DRIVE_STATE_REBUILDING);
    assert!(drive.path.ends_with("drive-001.img"), "{}", drive.path);
    let deadline = Instant::now() + REBUILD_TIMEOUT;
    let info = loop {
        let info = client.node().unwrap();
        let erasure = info.erasure.clone().expect("erasure info");
        if erasure.rebuild.is_none() && erasure.last_rebuild.is_some() {
            break info;
        }
        assert!(Instant::now() < deadline, "no rebuild end: {info:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let erasure = info.erasure.expect("erasure info");
    let last = erasure.last_rebuild.expect("last rebuild");
    assert!(last.finished && last.error.is_none() && last.drive == 1, "{last:?}");
    assert_eq!(
        (erasure.scheme.as_str(), erasure.data_shards, erasure.parity_shards),
        ("2+1", 2, 1)
    );
    let states: Vec<&str> = info.drives.iter().map(|drive| drive.state.as_str()).collect();
    assert_eq!(states, ["ok", "ok", "ok"]);
    // A second replacement of the same drive works as well (the first one's RAM is freed).
    client.replace_drive(1, None).unwrap();
    node.stop().unwrap();
}
