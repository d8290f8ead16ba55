//! A private etcd server for tests, so that the etcd store is tested against the real thing.
//!
//! Each [`EtcdServer`] is one `etcd` process (Debian's `etcd-server` package, installed by
//! `scripts/deps.sh`) listening on free ports of 127.0.0.1, with its data in a temporary
//! directory in RAM (/dev/shm, where there is one: [`etcd_data_dir`]). It is killed, by the
//! process id this helper started, when the value is dropped. A missing `etcd` binary fails the
//! test with what to do, never skips it.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long etcd may take to start and elect itself leader (well under a second when idle).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How many fresh starts are tried when etcd exits at once, as it does when another process
/// took one of its picked ports between the pick and etcd's bind.
const START_ATTEMPTS_MAX: u32 = 3;
const HEALTH_POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Bounds one health request, so a half-started etcd cannot stall the wait.
const HEALTH_REQUEST_TIMEOUT: Duration = Duration::from_millis(500);
/// The most bytes of a health answer read, and of etcd's log quoted in a failure message.
const HEALTH_ANSWER_BYTES_MAX: u64 = 4096;
const LOG_TAIL_BYTES_MAX: usize = 4096;

/// A temporary directory for a test etcd's data, in RAM (/dev/shm) where the machine has it
/// (the cli crate's cluster tests start their etcd in one too).
///
/// etcd syncs its log to disk at every write, and the tests run on a shared disk that pauses for
/// a second or more at times (docs/BENCHMARKS.md, "the disk's longest stall"): with the tests'
/// short leases, such a pause on etcd's disk lapses every node's lease at once and fails the
/// cluster over in the middle of a test that expects no failover. In RAM, etcd answers at its
/// own pace; what is tested is Ferrite, not the disk under etcd. Falls back to the default
/// temporary directory where /dev/shm is missing or not writable.
pub fn etcd_data_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ferrite-etcd-")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("create a temporary directory for etcd")
}

/// A running etcd of one member, for tests. Killed on drop.
pub struct EtcdServer {
    /// `None` once stopped.
    child: Option<Child>,
    client_url: String,
    /// Holds the data dir and the log; removed on drop, after the process is gone (fields drop
    /// after `Drop::drop` has stopped it).
    _dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts etcd and waits until it answers its health check. Panics, with etcd's log, if it
    /// cannot; a test cannot go on without it.
    pub fn start() -> Self {
        for attempt in 1..=START_ATTEMPTS_MAX {
            let dir = etcd_data_dir();
            let (client_port, peer_port) = free_ports();
            let client_url = format!("http://127.0.0.1:{client_port}");
            let peer_url = format!("http://127.0.0.1:{peer_port}");
            let data_dir = dir.path().join("data");
            let log_path = dir.path().join("etcd.log");
            let log = File::create(&log_path).expect("create etcd's log file");
            let log_err = log.try_clone().expect("clone etcd's log file");
            let spawned = Command::new("etcd")
                .arg("--name=test")
                .arg(format!("--data-dir={}", data_dir.display()))
                .arg(format!("--listen-client-urls={client_url}"))
                .arg(format!("--advertise-client-urls={client_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=test={peer_url}"))
                .arg("--initial-cluster-state=new")
                .arg("--logger=zap")
                .arg("--log-outputs=stderr")
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log_err)
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => panic!(
                    "etcd is not installed; run scripts/deps.sh, which installs Debian's \
                     etcd-server package (the etcd store's tests need a real etcd)"
                ),
                Err(error) => panic!("cannot start etcd: {error}"),
            };
            let mut server = Self { child: Some(child), client_url, _dir: dir };
            match server.wait_healthy(client_port) {
                Ok(()) => return server,
                // Dropping the server removes its directory; the next attempt starts afresh.
                Err(exited) if exited && attempt < START_ATTEMPTS_MAX => drop(server),
                Err(_) => {
                    server.stop();
                    panic!(
                        "etcd at {} exited, or was not healthy within {} s; its log:\n{}",
                        server.client_url,
                        START_TIMEOUT.as_secs(),
                        log_tail(&log_path)
                    );
                }
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// The client URL, `http://127.0.0.1:<port>`.
    pub fn client_url(&self) -> &str {
        &self.client_url
    }

    /// The endpoints to give [`crate::EtcdStore::connect`].
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.client_url.clone()]
    }

    /// Stops etcd with SIGSTOP, by the process id this helper started: it keeps its
    /// connections and answers nothing (a test of an etcd that hangs) until [`Self::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Continues an etcd stopped by [`Self::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("a running etcd");
        let status = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {} failed: {status}", child.id());
    }

    /// Kills etcd now (a test of an etcd that went away). Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A paused etcd dies of SIGKILL as well.
            // Kills the process this helper started, by its id; it may have exited already.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for a healthy etcd; `Err(true)` if etcd exited, `Err(false)` on the timeout.
    fn wait_healthy(&mut self, client_port: u16) -> Result<(), bool> {
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            let child = self.child.as_mut().expect("a started server has a child");
            if !matches!(child.try_wait(), Ok(None)) {
                return Err(true);
            }
            if is_healthy(client_port) {
                return Ok(());
            }
            std::thread::sleep(HEALTH_POLL_INTERVAL);
        }
        Err(false)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Two distinct free ports of 127.0.0.1, held together while picked so they differ.
fn free_ports() -> (u16, u16) {
    let first = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let second = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let port = |listener: &TcpListener| listener.local_addr().expect("a bound address").port();
    (port(&first), port(&second))
}

/// Whether etcd's `/health` says it has a leader and serves requests.
fn is_healthy(client_port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", client_port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(HEALTH_REQUEST_TIMEOUT));
    let _ = stream.set_write_timeout(Some(HEALTH_REQUEST_TIMEOUT));
    let request = format!("GET /health HTTP/1.0\r\nHost: 127.0.0.1:{client_port}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.take(HEALTH_ANSWER_BYTES_MAX).read_to_string(&mut answer);
    answer.starts_with("HTTP/1.") && answer.contains(r#""health":"true""#)
}

fn log_tail(path: &Path) -> String {
    let log = std::fs::read(path).unwrap_or_default();
    let start = log.len().saturating_sub(LOG_TAIL_BYTES_MAX);
    String::from_utf8_lossy(&log[start..]).into_owned()
}
