//! Host access control end to end: `ferrite host allow|deny|list` against a real `ferrite up`,
//! checked from the host side with the initiator under several host NQNs. An allowed host
//! connects and does I/O; a host not allowed is refused at Connect with Connect Invalid Host
//! (SCT 1, SC 84h) and does not see the volume in its discovery log; a denied host's controller
//! is disconnected while other hosts keep theirs; the lists survive a restart.

mod common;

use common::{assert_no_error_lines, ferrite, ferrite_ok, free_port, pattern, runtime, Node};
use initiator::{
    AlignedBuf, ConnectOptions, Controller, HostIdentity, InitiatorError, IoQueue, Nqn, Status,
};
use std::process::Command;
use std::time::{Duration, Instant};

/// A controller of a denied host must be gone within this time.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

fn host(last_byte: u8) -> HostIdentity {
    let mut uuid = [0x11; 16];
    uuid[6] = 0x41;
    uuid[8] = 0x81;
    uuid[15] = last_byte;
    HostIdentity::from_uuid(uuid)
}

fn options(host: &HostIdentity) -> ConnectOptions {
    ConnectOptions { host: Some(host.clone()), ..ConnectOptions::default() }
}

fn volume_nqn(volume: &str) -> Nqn {
    common::volume_nqn(volume)
}

async fn connect(address: &str, volume: &str, host: &HostIdentity) -> (Controller, IoQueue) {
    let controller = Controller::connect(address, &volume_nqn(volume), options(host))
        .await
        .unwrap_or_else(|error| panic!("host {} connect to {volume}: {error}", host.nqn));
    let queue = controller.open_io_queue(8).await.expect("open an I/O queue");
    (controller, queue)
}

/// Writes a pattern and reads it back: the connection serves I/O.
async fn check_io(queue: &mut IoQueue, lba: u64, tag: u64, context: &str) {
    queue
        .write(lba, pattern(lba, 1, tag))
        .await
        .unwrap_or_else(|error| panic!("{context}: write: {error}"));
    let data = queue
        .read(lba, AlignedBuf::new(common::BLOCK_BYTES))
        .await
        .unwrap_or_else(|error| panic!("{context}: read: {error}"));
    assert_eq!(&data[..], &pattern(lba, 1, tag)[..], "{context}: read back");
}

/// Requires that `host` is refused at Connect with Connect Invalid Host, and says why.
async fn assert_refused(address: &str, volume: &str, host: &HostIdentity) {
    let result = Controller::connect(address, &volume_nqn(volume), options(host)).await;
    let error = match result {
        Err(error) => error,
        Ok(_) => panic!("host {} connected to {volume} but is not allowed", host.nqn),
    };
    match &error {
        InitiatorError::ConnectRejected { status, qid: 0, .. } => {
            assert!(status.same_code(Status::CONNECT_INVALID_HOST), "{error}");
            assert_eq!((status.status_code_type(), status.status_code()), (1, 0x84), "{error}");
            assert!(status.do_not_retry(), "a refused host should not retry: {error}");
        }
        other => panic!("host {} connect to {volume}: {other:?}", host.nqn),
    }
    assert!(error.to_string().contains("not allowed"), "{error}");
}

/// The subsystem NQNs `host` sees in the discovery log, without the discovery subsystem.
async fn discovered(address: &str, host: &HostIdentity) -> Vec<String> {
    let entries = initiator::discover_with(
        address,
        ConnectOptions { keep_alive_timeout: Duration::ZERO, ..options(host) },
    )
    .await
    .unwrap_or_else(|error| panic!("discovery as {}: {error}", host.nqn));
    let mut nqns: Vec<String> = entries
        .into_iter()
        .map(|entry| entry.subnqn)
        .filter(|nqn| nqn != types::DISCOVERY_NQN)
        .collect();
    nqns.sort();
    nqns
}

/// Waits until the controller's connection is closed by the target: a command fails.
async fn assert_disconnected(controller: &Controller, queue: &mut IoQueue, context: &str) {
    let deadline = Instant::now() + CLOSE_TIMEOUT;
    loop {
        let identify =
            tokio::time::timeout(COMMAND_TIMEOUT, controller.identify_namespace(1)).await;
        let read = tokio::time::timeout(
            COMMAND_TIMEOUT,
            queue.read(0, AlignedBuf::new(common::BLOCK_BYTES)),
        )
        .await;
        if matches!(identify, Ok(Err(_))) && matches!(read, Ok(Err(_))) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{context}: the controller still answers: identify {identify:?}, read {:?}",
            read.map(|result| result.map(drop))
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn host_list(api: &str, volume: &str) -> serde_json::Value {
    let text = ferrite_ok(api, &["host", "list", volume, "--json"]);
    serde_json::from_str(&text).expect("host list JSON")
}

/// Runs a command that must fail; returns its stderr.
#[track_caller]
fn ferrite_fails(api: &str, args: &[&str]) -> String {
    let output = ferrite(api, args);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "ferrite {args:?} succeeded");
    stderr
}

#[test]
fn allowed_hosts_connect_and_see_the_volume_others_do_not() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let node = Node::start(&data_dir, nvme_port);
    let api = node.api_url.clone();
    let address = node.nvme_address();
    let allowed = host(0xA);
    let stranger = host(0xB);
    let allowed_nqn = allowed.nqn.as_str().to_owned();
    let stranger_nqn = stranger.nqn.as_str().to_owned();
    let (db, open) = (volume_nqn("db").to_string(), volume_nqn("open").to_string());

    ferrite_ok(&api, &["volume", "create", "db", "--size", "64M"]);
    ferrite_ok(&api, &["volume", "create", "open", "--size", "64M"]);
    let list = ferrite_ok(&api, &["host", "list", "db"]);
    assert!(list.contains("open: any host may connect"), "{list}");
    let show = ferrite_ok(&api, &["volume", "show", "db"]);
    assert!(show.contains("open (any host may connect)"), "{show}");

    let rt = runtime();
    rt.block_on(async {
        // Open: every host connects and sees both volumes.
        assert_eq!(discovered(&address, &stranger).await, [db.as_str(), open.as_str()]);
        let (early, mut early_queue) = connect(&address, "db", &stranger).await;
        check_io(&mut early_queue, 1, 0xE1, "a host of the open volume").await;

        // The first allowed host restricts the volume: the stranger is disconnected.
        let output = ferrite_ok(&api, &["host", "allow", "db", &allowed_nqn]);
        assert!(output.contains(&format!("allowed host {allowed_nqn} on volume db")), "{output}");
        assert!(output.contains("restricted: only this host may connect"), "{output}");
        assert!(output.contains(&format!("  {allowed_nqn}")), "{output}");
        assert_disconnected(&early, &mut early_queue, "the stranger after restricting").await;
        drop((early, early_queue));

        let (kept, mut kept_queue) = connect(&address, "db", &allowed).await;
        check_io(&mut kept_queue, 2, 0xA1, "the allowed host").await;
        assert_refused(&address, "db", &stranger).await;
        assert_eq!(discovered(&address, &allowed).await, [db.as_str(), open.as_str()]);
        assert_eq!(discovered(&address, &stranger).await, [open.as_str()]);
        // The other volume is still open to the stranger.
        let (other, mut other_queue) = connect(&address, "open", &stranger).await;
        check_io(&mut other_queue, 3, 0xB1, "the stranger on the open volume").await;

        // Allow the stranger, then deny it again: only its controller goes.
        ferrite_ok(&api, &["host", "allow", "db", &stranger_nqn]);
        assert_eq!(discovered(&address, &stranger).await, [db.as_str(), open.as_str()]);
        let (late, mut late_queue) = connect(&address, "db", &stranger).await;
        check_io(&mut late_queue, 4, 0xB2, "the stranger once allowed").await;
        let listed = host_list(&api, "db");
        assert_eq!(listed["access"], "restricted");
        let mut expected = vec![allowed_nqn.clone(), stranger_nqn.clone()];
        expected.sort();
        assert_eq!(listed["hosts"], serde_json::json!(expected));

        let output = ferrite_ok(&api, &["host", "deny", "db", &stranger_nqn]);
        assert!(output.contains(&format!("denied host {stranger_nqn} on volume db")), "{output}");
        assert_disconnected(&late, &mut late_queue, "the denied stranger").await;
        drop((late, late_queue));
        assert_refused(&address, "db", &stranger).await;
        check_io(&mut kept_queue, 5, 0xA2, "the allowed host after another was denied").await;
        check_io(&mut other_queue, 6, 0xB3, "the stranger on the other volume").await;

        // Deny any: nobody, not even the allowed host.
        let output = ferrite_ok(&api, &["host", "deny", "db", "any"]);
        assert!(output.contains("denied any host on volume db"), "{output}");
        assert!(output.contains("restricted: no host may connect"), "{output}");
        assert_disconnected(&kept, &mut kept_queue, "the allowed host after deny any").await;
        drop((kept, kept_queue));
        assert_refused(&address, "db", &allowed).await;
        assert_eq!(discovered(&address, &allowed).await, [open.as_str()]);

        // Allow any: open again.
        let reopened: serde_json::Value =
            serde_json::from_str(&ferrite_ok(&api, &["host", "allow", "db", "any", "--json"]))
                .expect("JSON");
        assert_eq!(reopened["access"], "open");
        assert_eq!(reopened["hosts"], serde_json::json!([]));
        let (again, again_queue) = connect(&address, "db", &stranger).await;
        drop(again_queue);
        again.shutdown().await.expect("shut down");
        drop(other_queue);
        other.shutdown().await.expect("shut down");
    });

    // Refusals are clear and change nothing.
    let stderr = ferrite_fails(&api, &["host", "deny", "open", &stranger_nqn]);
    assert!(stderr.contains("volume open is open to any host"), "{stderr}");
    assert!(stderr.contains("ferrite host allow open HOSTNQN"), "{stderr}");
    let stderr = ferrite_fails(&api, &["host", "allow", "db", "my-host"]);
    assert!(stderr.contains("invalid NQN \"my-host\""), "{stderr}");
    assert!(stderr.contains("/etc/nvme/hostnqn"), "{stderr}");
    let stderr = ferrite_fails(&api, &["host", "list", "nope"]);
    assert!(stderr.contains("volume nope does not exist"), "{stderr}");
    assert_eq!(host_list(&api, "open")["access"], "open");

    // The list survives a restart and is enforced from the first Connect.
    ferrite_ok(&api, &["host", "allow", "db", &allowed_nqn]);
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "host access");
    let node = Node::start(&data_dir, nvme_port);
    let api = node.api_url.clone();
    assert_eq!(host_list(&api, "db")["hosts"], serde_json::json!([allowed_nqn]));
    let show = ferrite_ok(&api, &["volume", "show", "db"]);
    assert!(show.contains("restricted (only allowed hosts may connect"), "{show}");
    rt.block_on(async {
        assert_refused(&address, "db", &stranger).await;
        assert_eq!(discovered(&address, &stranger).await, [open.as_str()]);
        let (controller, mut queue) = connect(&address, "db", &allowed).await;
        check_io(&mut queue, 2, 0xA1, "the allowed host after a restart").await;
        drop(queue);
        controller.shutdown().await.expect("shut down");
    });
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "host access after a restart");
}

#[test]
fn host_help_explains_the_model() {
    for command in [&["host"][..], &["host", "allow"], &["host", "deny"], &["host", "list"]] {
        let output =
            Command::new(common::FERRITE).args(command).arg("--help").output().expect("run");
        let help = String::from_utf8(output.stdout).expect("UTF-8 help");
        assert!(output.status.success(), "{command:?} --help failed");
        assert!(help.contains("Example"), "`ferrite {command:?} --help` has no example:\n{help}");
    }
    let output = Command::new(common::FERRITE).args(["host", "--help"]).output().expect("run");
    let help = String::from_utf8(output.stdout).expect("UTF-8 help");
    for needle in ["open", "restricted", "ferrite host deny VOLUME any", "/etc/nvme/hostnqn"] {
        assert!(help.contains(needle), "`ferrite host --help` lacks {needle:?}:\n{help}");
    }
}
