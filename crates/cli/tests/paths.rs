//! Several NVMe/TCP ports on one node, as a host's native multipath uses them: `ferrite up` with
//! two `--nvme-listen` addresses lists both in the discovery log, `ferrite volume paths` shows
//! the volume's ANA state on each, and `ferrite volume set-path` moves a connected host (the
//! Ferrite initiator's multipath, which follows ANA change notices as Linux does) from one port
//! to the other without any I/O failing. Bad ports and states are refused with clear errors.

mod common;

use common::{ferrite, ferrite_ok, free_port, pattern, pattern_mismatch, volume_nqn, Node};
use initiator::{MultipathNamespace, PathState};
use std::time::{Duration, Instant};

/// A notice reaches the host and is handled well within this (connections tick every 200 ms).
const NOTICE_TIMEOUT: Duration = Duration::from_secs(15);
const POLL_INTERVAL: Duration = Duration::from_millis(20);
const BLOCKS: usize = 8;

fn states(device: &MultipathNamespace) -> Vec<PathState> {
    device.paths().iter().map(|path| path.state).collect()
}

async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + NOTICE_TIMEOUT;
    while !done() {
        assert!(Instant::now() < deadline, "not within {NOTICE_TIMEOUT:?}: {what}");
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

#[test]
fn set_path_moves_a_multipath_host_between_ports_without_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let first_port = free_port();
    let second_port = free_port();
    let second = format!("127.0.0.1:{second_port}");
    let node = Node::start_with_drives(
        dir.path(),
        first_port,
        &["--drives", "2", "--drive-size", "1G", "--nvme-listen", &second],
    );
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "mp", "--size", "64M"]);

    let listed: serde_json::Value =
        serde_json::from_str(&ferrite_ok(&api, &["volume", "paths", "mp", "--json"])).unwrap();
    let paths = listed["paths"].as_array().unwrap();
    assert_eq!(paths.len(), 2, "{listed}");
    assert_eq!(paths[0]["port_id"], 1);
    assert_eq!(paths[0]["address"], format!("127.0.0.1:{first_port}"));
    assert_eq!(paths[1]["port_id"], 2);
    assert_eq!(paths[1]["address"], second);
    assert!(paths.iter().all(|path| path["ana_state"] == "optimized"), "{listed}");

    let runtime = common::runtime();
    runtime.block_on(async {
        // Both ports are in the discovery log.
        let host = initiator::default_host().nqn.clone();
        let entries = initiator::discover(node.nvme_address(), &host).await.unwrap();
        let ports: Vec<(u16, String)> = entries
            .iter()
            .filter(|entry| entry.subnqn == volume_nqn("mp").as_str())
            .map(|entry| (entry.port_id, entry.trsvcid.clone()))
            .collect();
        assert_eq!(
            ports,
            [(1, first_port.to_string()), (2, second_port.to_string())],
            "{entries:?}"
        );

        let addresses = [node.nvme_address(), second.clone()];
        let mut device =
            MultipathNamespace::connect(&addresses, &volume_nqn("mp"), Default::default(), 8)
                .await
                .unwrap();
        assert_eq!(device.current_path(), Some(0));
        let data = pattern(0, BLOCKS, 1);
        device.write(0, &data).await.unwrap();

        // Drain port 1: the host learns it from the notice alone and moves to port 2.
        let out = ferrite_ok(
            &api,
            &["volume", "set-path", "mp", "--port", "1", "--state", "inaccessible"],
        );
        assert!(out.contains("port 1 is now inaccessible"), "{out}");
        eventually("the host moves to port 2", || {
            device.current_path() == Some(1)
                && states(&device) == [PathState::Inaccessible, PathState::Optimized]
        })
        .await;
        let read = device.read(0, BLOCKS * 4096).await.unwrap();
        assert_eq!(pattern_mismatch(&read, 0, 1), None);
        device.write(100, &pattern(100, BLOCKS, 2)).await.unwrap();
        assert_eq!(device.failovers(), 0, "no command failed on a path");

        // Port 2 non-optimized and port 1 back (named by its address): the host prefers port 1.
        ferrite_ok(&api, &["volume", "set-path", "mp", "--port", "2", "--state", "non-optimized"]);
        let first = node.nvme_address();
        ferrite_ok(&api, &["volume", "set-path", "mp", "--port", &first, "--state", "optimized"]);
        eventually("the host moves back to port 1", || {
            device.current_path() == Some(0)
                && states(&device) == [PathState::Optimized, PathState::NonOptimized]
        })
        .await;
        let read = device.read(100, BLOCKS * 4096).await.unwrap();
        assert_eq!(pattern_mismatch(&read, 100, 2), None);
        assert_eq!(device.failovers(), 0);
    });

    let listed = ferrite_ok(&api, &["volume", "paths", "mp"]);
    assert!(listed.contains("non-optimized"), "{listed}");

    // Bad input: an unknown port, a state set only by the cluster, an unknown volume.
    let refused =
        ferrite(&api, &["volume", "set-path", "mp", "--port", "3", "--state", "optimized"]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("no NVMe/TCP port 3") && stderr.contains("1 to 2"), "{stderr}");
    let refused = ferrite(&api, &["volume", "set-path", "mp", "--port", "1", "--state", "change"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("optimized, non-optimized"));
    let refused = ferrite(
        &api,
        &["volume", "set-path", "mp", "--port", "127.0.0.1:1", "--state", "optimized"],
    );
    assert!(String::from_utf8_lossy(&refused.stderr).contains("has no path at 127.0.0.1:1"));
    let refused =
        ferrite(&api, &["volume", "set-path", "nope", "--port", "1", "--state", "optimized"]);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("does not exist"));

    // A deleted and re-created volume starts with every path optimized again.
    ferrite_ok(&api, &["volume", "delete", "mp"]);
    ferrite_ok(&api, &["volume", "create", "mp", "--size", "64M"]);
    let listed: serde_json::Value =
        serde_json::from_str(&ferrite_ok(&api, &["volume", "paths", "mp", "--json"])).unwrap();
    let paths = listed["paths"].as_array().unwrap();
    assert!(paths.iter().all(|path| path["ana_state"] == "optimized"), "{listed}");
    node.stop_cleanly();
}

fn path_states(api: &str, volume: &str) -> Vec<(u64, String)> {
    let listed: serde_json::Value =
        serde_json::from_str(&ferrite_ok(api, &["volume", "paths", volume, "--json"])).unwrap();
    listed["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|path| {
            (path["port_id"].as_u64().unwrap(), path["ana_state"].as_str().unwrap().to_owned())
        })
        .collect()
}

/// States set by hand outlive a restart, and a host connecting afterwards is told them; a port
/// the restarted node does not listen on keeps its state until it is back.
#[test]
fn hand_set_states_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let first_port = free_port();
    let second = format!("127.0.0.1:{}", free_port());
    let both = ["--drives", "2", "--drive-size", "1G", "--nvme-listen", second.as_str()];
    let node = Node::start_with_drives(dir.path(), first_port, &both);
    let api = node.api_url.clone();
    ferrite_ok(&api, &["volume", "create", "kept", "--size", "64M"]);
    ferrite_ok(&api, &["volume", "create", "plain", "--size", "64M"]);
    ferrite_ok(&api, &["volume", "set-path", "kept", "--port", "2", "--state", "inaccessible"]);
    ferrite_ok(&api, &["volume", "set-path", "kept", "--port", "1", "--state", "non-optimized"]);
    node.stop_cleanly();

    let node = Node::start_with_drives(dir.path(), first_port, &both);
    let api = node.api_url.clone();
    let optimized = |port: u64| (port, "optimized".to_owned());
    assert_eq!(
        path_states(&api, "kept"),
        [(1, "non-optimized".to_owned()), (2, "inaccessible".to_owned())]
    );
    assert_eq!(path_states(&api, "plain"), [optimized(1), optimized(2)]);
    let runtime = common::runtime();
    runtime.block_on(async {
        let addresses = [node.nvme_address(), second.clone()];
        let mut device =
            MultipathNamespace::connect(&addresses, &volume_nqn("kept"), Default::default(), 8)
                .await
                .unwrap();
        eventually("the host is told the kept states", || {
            states(&device) == [PathState::NonOptimized, PathState::Inaccessible]
        })
        .await;
        assert_eq!(device.current_path(), Some(0), "the non-optimized path is the only usable one");
        device.write(0, &pattern(0, BLOCKS, 3)).await.unwrap();
    });
    // Port 1 set optimized again: nothing is kept for it.
    ferrite_ok(&api, &["volume", "set-path", "kept", "--port", "1", "--state", "optimized"]);
    node.stop_cleanly();

    // Restarted with port 1 only: port 2's state is not applied (a warning says so), and kept.
    let node =
        Node::start_with_drives(dir.path(), first_port, &["--drives", "2", "--drive-size", "1G"]);
    let api = node.api_url.clone();
    assert_eq!(path_states(&api, "kept"), [optimized(1)]);
    let stderr = node.stop_cleanly();
    assert!(
        stderr.contains("NVMe port this node does not have now") && stderr.contains("kept"),
        "{stderr}"
    );
    let node = Node::start_with_drives(dir.path(), first_port, &both);
    let api = node.api_url.clone();
    assert_eq!(path_states(&api, "kept"), [optimized(1), (2, "inaccessible".to_owned())]);
    // Deleting the volume deletes what it kept.
    ferrite_ok(&api, &["volume", "delete", "kept"]);
    ferrite_ok(&api, &["volume", "create", "kept", "--size", "64M"]);
    node.stop_cleanly();
    let node = Node::start_with_drives(dir.path(), first_port, &both);
    assert_eq!(path_states(&node.api_url, "kept"), [optimized(1), optimized(2)]);
    node.stop_cleanly();
}

#[test]
fn the_same_address_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let output = std::process::Command::new(common::FERRITE)
        .args(["up", "--data-dir"])
        .arg(dir.path())
        .args(["--api-listen", "127.0.0.1:0", "--drives", "1", "--drive-size", "1G"])
        .args(["--nbd-listen", "off"])
        .args(["--nvme-listen", &format!("127.0.0.1:{port}")])
        .args(["--nvme-listen", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot listen for NVMe/TCP"), "{stderr}");
}
