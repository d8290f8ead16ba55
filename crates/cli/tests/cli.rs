//! The `ferrite` binary end to end: `ferrite up` as a real process in a temporary data dir, the
//! `ferrite volume` commands against it, the error messages users see, a clean stop on SIGTERM
//! and SIGINT, and volumes surviving a restart.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const FERRITE: &str = env!("CARGO_BIN_EXE_ferrite");
/// How long `ferrite up` may take to start serving or to stop.
const NODE_TIMEOUT: Duration = Duration::from_secs(30);

/// A port nothing listens on right now: the OS hands it out and we give it back.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A running `ferrite up`. Dropping it kills the process (only this one, by its own handle).
struct Up {
    child: Child,
    api_url: String,
    stdout: mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Up {
    fn start(data_dir: &Path, nvme_port: u16) -> Self {
        let mut child = Command::new(FERRITE)
            .args(["up", "--data-dir"])
            .arg(data_dir)
            .args(["--api-listen", "127.0.0.1:0"])
            .args(["--nvme-listen", &format!("127.0.0.1:{nvme_port}")])
            .args(["--nbd-listen", "127.0.0.1:0"])
            .args(["--drives", "2", "--drive-size", "4G"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (sender, stdout) = mpsc::channel();
        let reader = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut stderr_pipe = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr_pipe.read_to_string(&mut text);
            text
        });
        let mut up = Self { child, api_url: String::new(), stdout, stderr: Some(stderr) };
        let line = up.line_containing("REST API:");
        up.api_url = line.split_whitespace().last().unwrap().to_owned();
        up.wait_healthy();
        up
    }

    fn line_containing(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + NODE_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => panic!("`ferrite up` printed no line with {needle:?}"),
            }
        }
    }

    fn wait_healthy(&self) {
        let client = api::Client::new(&self.api_url).unwrap();
        let deadline = Instant::now() + NODE_TIMEOUT;
        while let Err(error) = client.health() {
            assert!(Instant::now() < deadline, "/healthz never answered: {error}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends `signal` to this node's process and waits for it to exit; returns its stderr.
    fn stop_with(mut self, signal: libc::c_int) -> String {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) has no memory effects; `pid` is our own child, which has not been
        // waited for, so the PID cannot have been reused by another process.
        let sent = unsafe { libc::kill(pid, signal) };
        assert_eq!(sent, 0, "kill failed");
        let deadline = Instant::now() + NODE_TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "`ferrite up` did not stop after signal {signal}");
            std::thread::sleep(Duration::from_millis(50));
        };
        self.line_containing("stopped cleanly");
        let stderr = self.stderr.take().unwrap().join().unwrap();
        assert!(status.success(), "`ferrite up` exited with {status}; stderr:\n{stderr}");
        stderr
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn ferrite(api_url: &str, args: &[&str]) -> Output {
    Command::new(FERRITE).args(args).env("FERRITE_API", api_url).output().unwrap()
}

/// Runs a command that must succeed; returns its stdout.
#[track_caller]
fn ok(api_url: &str, args: &[&str]) -> String {
    let output = ferrite(api_url, args);
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(output.status.success(), "ferrite {args:?} failed: {stderr}");
    stdout
}

/// Runs a command that must fail; returns its stderr.
#[track_caller]
fn fails(api_url: &str, args: &[&str]) -> String {
    let output = ferrite(api_url, args);
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(!output.status.success(), "ferrite {args:?} succeeded");
    assert!(output.stdout.is_empty(), "ferrite {args:?} printed to stdout on error");
    stderr
}

#[track_caller]
fn assert_contains(text: &str, expect: &str) {
    assert!(text.contains(expect), "{text:?} does not contain {expect:?}");
}

#[test]
fn volumes_through_the_cli_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let up = Up::start(&data_dir, nvme_port);
    let api = up.api_url.as_str();

    assert_contains(&ok(api, &["volume", "list"]), "no volumes");
    assert_contains(
        &ok(api, &["volume", "create", "db", "--size", "1G"]),
        "created volume db (1GiB)",
    );
    // --api wins over FERRITE_API.
    let created =
        ok("http://127.0.0.1:1", &["volume", "create", "logs", "--size", "512M", "--api", api]);
    assert_contains(&created, "created volume logs (512MiB)");

    let list = ok(api, &["volume", "list"]);
    let lines: Vec<&str> = list.lines().collect();
    assert!(lines[0].starts_with("NAME"), "{list}");
    assert!(lines[1].starts_with("db ") && lines[1].contains("1GiB"), "{list}");
    assert!(lines[2].starts_with("logs ") && lines[2].contains("512MiB"), "{list}");

    let show = ok(api, &["volume", "show", "db"]);
    assert_contains(&show, "nqn.2024-01.io.ferrite:vol:db");
    assert_contains(
        &show,
        &format!(
            "nvme connect -t tcp -a 127.0.0.1 -s {nvme_port} -n nqn.2024-01.io.ferrite:vol:db"
        ),
    );

    assert_contains(&ok(api, &["volume", "resize", "db", "2G"]), "resized volume db (2GiB)");
    let shown: serde_json::Value =
        serde_json::from_str(&ok(api, &["volume", "show", "db", "--json"])).unwrap();
    assert_eq!(shown["size_bytes"], 2u64 << 30);
    assert_eq!(shown["nqn"], "nqn.2024-01.io.ferrite:vol:db");

    // Errors: message on stderr, nothing on stdout, non-zero exit.
    assert_contains(
        &fails(api, &["volume", "resize", "db", "1G"]),
        "error: volume db is 2GiB and cannot shrink to 1GiB: volumes only grow",
    );
    assert_contains(
        &fails(api, &["volume", "create", "db", "--size", "1G"]),
        "error: volume db already exists",
    );
    assert_contains(
        &fails(api, &["volume", "create", "odd", "--size", "4097"]),
        "error: invalid volume size 4097 bytes: it must be a multiple of 4096",
    );
    assert_contains(
        &fails(api, &["volume", "create", "odd", "--size", "1.5G"]),
        "invalid size \"1.5G\"",
    );
    assert_contains(
        &fails(api, &["volume", "create", "Odd", "--size", "1G"]),
        "error: invalid volume name \"Odd\"",
    );
    assert_contains(&fails(api, &["volume", "show", "nope"]), "error: volume nope does not exist");
    assert_contains(
        &fails(api, &["volume", "delete", "nope"]),
        "error: volume nope does not exist",
    );
    // Volumes are thin: one larger than the node's drives is created (a write beyond the real
    // space fails with Capacity Exceeded, see thin.rs).
    assert_contains(&ok(api, &["volume", "create", "huge", "--size", "10G"]), "volume huge");
    assert_contains(&ok(api, &["volume", "delete", "huge"]), "deleted volume huge");
    let closed = format!("http://127.0.0.1:{}", free_port());
    assert_eq!(
        fails(&closed, &["volume", "list"]).trim_end(),
        format!(
            "error: cannot reach the Ferrite API at {closed}: connection refused; is `ferrite up` running?"
        )
    );

    assert_contains(&ok(api, &["volume", "delete", "logs"]), "deleted volume logs");
    let stderr = up.stop_with(libc::SIGTERM);
    assert!(!stderr.contains("ERROR"), "unexpected error log:\n{stderr}");

    // Started again on the same data dir: the volumes are still there.
    let up = Up::start(&data_dir, nvme_port);
    let api = up.api_url.as_str();
    let listed: api::VolumeList =
        serde_json::from_str(&ok(api, &["volume", "list", "--json"])).unwrap();
    let names: Vec<(&str, u64)> =
        listed.volumes.iter().map(|volume| (volume.name.as_str(), volume.size_bytes)).collect();
    assert_eq!(names, [("db", 2 << 30)]);
    assert_eq!(listed.volumes[0].id, shown["id"].as_u64().unwrap());
    let stderr = up.stop_with(libc::SIGINT);
    assert!(!stderr.contains("ERROR"), "unexpected error log:\n{stderr}");
}

#[test]
fn a_second_node_on_the_same_data_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = Up::start(dir.path(), free_port());
    let output = Command::new(FERRITE)
        .args(["up", "--data-dir"])
        .arg(dir.path())
        .args(["--api-listen", "127.0.0.1:0", "--nvme-listen", "127.0.0.1:0"])
        .args(["--nbd-listen", "off"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert_contains(
        &String::from_utf8(output.stderr).unwrap(),
        "is another `ferrite up` running on this data dir?",
    );
    up.stop_with(libc::SIGTERM);
}

#[test]
fn help_teaches_at_every_level() {
    let commands: [&[&str]; 8] = [
        &[],
        &["up"],
        &["volume"],
        &["volume", "create"],
        &["volume", "list"],
        &["volume", "show"],
        &["volume", "delete"],
        &["volume", "resize"],
    ];
    for command in commands {
        let output = Command::new(FERRITE).args(command).arg("--help").output().unwrap();
        let help = String::from_utf8(output.stdout).unwrap();
        assert!(output.status.success(), "{command:?} --help failed");
        assert!(help.contains("Example"), "`ferrite {command:?} --help` has no example:\n{help}");
    }
    let output = Command::new(FERRITE).args(["volume"]).output().unwrap();
    assert!(!output.status.success(), "a missing subcommand is an error");
}
