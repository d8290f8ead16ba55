//! A real cluster for the end-to-end cluster tests: a private etcd and several `ferrite up
//! --cluster-etcd` processes, each with its own data dir (two sparse 1 GiB drives), NVMe/TCP
//! port and node name, that a test can kill (SIGKILL), stop and continue (SIGSTOP, SIGCONT),
//! restart on their data dir, and, with [`Network`], cut off the network.
//!
//! Everything is released on every path: dropping a [`Cluster`] kills its nodes (each by the PID
//! this harness started, never by name), then etcd, then deletes the network namespaces and
//! links, then the directories. When the test is failing (panicking), the drop first prints the
//! tail of etcd's log and of every node's, so the failure comes with what they said.
//!
//! [`Network`] puts each node in its own network namespace, joined to a bridge in the root
//! namespace by a veth pair; etcd and the test process stay in the root namespace and reach the
//! nodes through the bridge. Bringing a node's veth down cuts it off from etcd, its peers and
//! the hosts at once, as a pulled cable does. Names and the subnet are drawn at random per
//! cluster and checked unused, so concurrent test runs do not collide.

use std::collections::BTreeSet;
use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rand::Rng as _;

use super::{free_port, stdout_lines, wait_with_timeout, Exit, DRIVE_ARGS, FERRITE, NODE_TIMEOUT};

/// Every node's lease (`--lease-ms`): the shortest etcd allows, so failovers are quick.
pub const LEASE_MS: u64 = 2_000;
/// How long the harness waits for the cluster to reach a state (a primary, replicas in sync,
/// a node seen dead) before the test fails.
pub const CONVERGE_TIMEOUT: Duration = Duration::from_secs(60);
/// Interval of those waits' polls.
pub const CONVERGE_POLL: Duration = Duration::from_millis(50);
/// Starts of one node tried while a port it needs is still held by its killed predecessor.
const START_ATTEMPTS_MAX: u32 = 40;
const START_RETRY_PAUSE: Duration = Duration::from_millis(250);
/// How long etcd may take to answer its health check.
const ETCD_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Starts of etcd tried when it exits at once (a picked port was taken meanwhile).
const ETCD_START_ATTEMPTS_MAX: u32 = 3;
/// Bounds one health request to etcd (connect, then read).
const ETCD_HEALTH_TIMEOUT: Duration = Duration::from_secs(1);
/// Bytes of etcd's health answer read at most.
const ETCD_HEALTH_ANSWER_BYTES_MAX: u64 = 4096;
/// Lines of etcd's log quoted when it does not start.
const ETCD_LOG_TAIL_LINES: usize = 30;
/// Lines of each node's log printed when a test fails.
const LOG_TAIL_LINES: usize = 150;
/// Nodes of one cluster at most (each gets an address of one /24 and a veth name digit).
pub const CLUSTER_NODES_MAX: usize = 9;
/// Random subnets tried before [`Network::create`] gives up finding an unused one.
const SUBNET_ATTEMPTS_MAX: u32 = 64;

/// Processes that end with the test that started them.
trait DieWithTest {
    /// The child gets SIGKILL when the thread that spawns it ends: the test's thread, which
    /// outlives every process it starts unless the test binary itself is killed (a timeout),
    /// when the guards' drops never run.
    fn die_with_test(&mut self) -> &mut Self;
}

impl DieWithTest for Command {
    fn die_with_test(&mut self) -> &mut Self {
        use std::os::unix::process::CommandExt as _;
        // SAFETY: the closure runs in the forked child before exec and only calls prctl(2),
        // which is async-signal-safe, touches no memory of the parent and allocates nothing.
        unsafe {
            self.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            })
        }
    }
}

/// A running etcd of one member, killed (by its PID) on drop; its data in a temporary dir.
pub struct Etcd {
    child: Option<Child>,
    client_url: String,
    log_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Etcd {
    /// Starts etcd serving clients on `client_ip` (and on 127.0.0.1) and waits until it is
    /// healthy.
    ///
    /// # Panics
    /// When etcd is missing or does not come up: nothing is skipped.
    pub fn start(client_ip: &str) -> Etcd {
        for attempt in 1..=ETCD_START_ATTEMPTS_MAX {
            // In RAM where the machine has it: a pause of the shared test disk would otherwise
            // lapse every node's 2 s lease at once (`meta::testing::etcd_data_dir`).
            let dir = meta::testing::etcd_data_dir();
            let client_port = free_port();
            let peer_url = format!("http://127.0.0.1:{}", free_port());
            let client_url = format!("http://{client_ip}:{client_port}");
            let mut listen = format!("http://127.0.0.1:{client_port}");
            if client_ip != "127.0.0.1" {
                listen.push_str(&format!(",{client_url}"));
            }
            let log_path = dir.path().join("etcd.log");
            let log = std::fs::File::create(&log_path).expect("create etcd's log");
            let spawned = Command::new("etcd")
                .arg("--name=test")
                .arg(format!("--data-dir={}", dir.path().join("data").display()))
                .arg(format!("--listen-client-urls={listen}"))
                .arg(format!("--advertise-client-urls={client_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=test={peer_url}"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("clone etcd's log"))
                .stderr(log)
                .die_with_test()
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => panic!(
                    "etcd is not installed: install Debian's etcd-server (scripts/deps.sh does) \
                     to run the cluster tests"
                ),
                Err(error) => panic!("cannot start etcd: {error}"),
            };
            let mut etcd = Etcd { child: Some(child), client_url, log_path, _dir: dir };
            let health = etcd_address(&etcd.client_url);
            let deadline = Instant::now() + ETCD_START_TIMEOUT;
            loop {
                let exited =
                    etcd.child.as_mut().is_some_and(|child| !matches!(child.try_wait(), Ok(None)));
                if exited && attempt < ETCD_START_ATTEMPTS_MAX {
                    break;
                }
                assert!(
                    !exited && Instant::now() < deadline,
                    "etcd did not become healthy at {}; its log:\n{}",
                    etcd.client_url,
                    etcd.log_tail()
                );
                if etcd_healthy(&health) {
                    return etcd;
                }
                std::thread::sleep(CONVERGE_POLL);
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// `http://IP:PORT`, what `--cluster-etcd` takes.
    pub fn client_url(&self) -> &str {
        &self.client_url
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        tail(&log, ETCD_LOG_TAIL_LINES)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `IP:PORT` of an etcd client URL.
fn etcd_address(client_url: &str) -> String {
    client_url.trim_start_matches("http://").to_owned()
}

/// Whether etcd at `address` (`IP:PORT`) reports itself healthy.
fn etcd_healthy(address: &str) -> bool {
    use std::io::{Read as _, Write as _};
    let Ok(address) = address.parse::<std::net::SocketAddr>() else { return false };
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&address, ETCD_HEALTH_TIMEOUT) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(ETCD_HEALTH_TIMEOUT));
    let request = format!("GET /health HTTP/1.0\r\nHost: {address}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.take(ETCD_HEALTH_ANSWER_BYTES_MAX).read_to_string(&mut answer);
    answer.contains(r#""health":"true""#)
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ----- Network namespaces -----

/// Checks what [`Network`] needs (root, `ip` with netns support), failing with what is
/// missing: nothing is skipped.
pub fn require_root_and_netns() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the network partition test needs root (it creates network namespaces, a bridge and \
         veth pairs with `ip`); run it as root"
    );
    super::client("ip", "iproute2");
}

/// Runs `ip ARGS`; the error holds its stderr.
fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|error| format!("cannot run ip: {error}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&output.stderr)))
    }
}

#[track_caller]
fn ip_ok(args: &[&str]) {
    if let Err(error) = ip(args) {
        panic!("{error} (the partition test needs root and network namespaces)");
    }
}

/// Network namespaces for the nodes of one cluster, on a bridge of the root namespace. Deleted
/// (the links, the bridge, the namespaces: only these, by the names made here) on drop, after
/// the nodes in them are gone.
pub struct Network {
    /// `10.A.B`: the bridge is `.1`, node `i` is `.(10 + i)`.
    subnet: String,
    bridge: Option<String>,
    /// Per node: (namespace, root-side veth), as created so far.
    nodes: Vec<(String, String)>,
}

impl Network {
    /// A bridge with a random unused /24 and `nodes` namespaces joined to it.
    ///
    /// # Panics
    /// When the namespaces cannot be made (see [`require_root_and_netns`]).
    pub fn create(nodes: usize) -> Network {
        assert!((1..=CLUSTER_NODES_MAX).contains(&nodes), "{nodes} nodes");
        let mut rng = rand::rng();
        let tag = format!("{:06x}", rng.random::<u32>() & 0xff_ffff);
        let used = addresses_in_use();
        let subnet = (0..SUBNET_ATTEMPTS_MAX)
            .map(|_| format!("10.{}.{}", rng.random_range(64..128u8), rng.random::<u8>()))
            .find(|subnet| !used.iter().any(|address| address.starts_with(&format!("{subnet}."))))
            .expect("an unused 10.x.y.0/24 subnet");
        let mut network = Network { subnet, bridge: None, nodes: Vec::new() };
        let bridge = format!("fbr{tag}");
        ip_ok(&["link", "add", &bridge, "type", "bridge"]);
        network.bridge = Some(bridge.clone());
        ip_ok(&["addr", "add", &format!("{}/24", network.bridge_ip()), "dev", &bridge]);
        ip_ok(&["link", "set", &bridge, "up"]);
        for index in 0..nodes {
            let namespace = format!("ferrite-test-{tag}-{index}");
            let outer = format!("fh{tag}{index}");
            let inner = format!("fn{tag}{index}");
            ip_ok(&["netns", "add", &namespace]);
            network.nodes.push((namespace.clone(), String::new()));
            ip_ok(&["link", "add", &outer, "type", "veth", "peer", "name", &inner]);
            network.nodes[index].1 = outer.clone();
            ip_ok(&["link", "set", &inner, "netns", &namespace]);
            ip_ok(&["link", "set", &outer, "master", &bridge, "up"]);
            let address = format!("{}/24", network.node_ip(index));
            ip_ok(&["-n", &namespace, "addr", "add", &address, "dev", &inner]);
            ip_ok(&["-n", &namespace, "link", "set", &inner, "up"]);
            ip_ok(&["-n", &namespace, "link", "set", "lo", "up"]);
        }
        network
    }

    /// The root namespace's address on the bridge (etcd listens there).
    pub fn bridge_ip(&self) -> String {
        format!("{}.1", self.subnet)
    }

    /// Node `index`'s address.
    pub fn node_ip(&self, index: usize) -> String {
        format!("{}.{}", self.subnet, 10 + index)
    }

    pub fn namespace(&self, index: usize) -> &str {
        &self.nodes[index].0
    }

    /// Brings node `index`'s link up or down (its root-side veth: the node sees its carrier go).
    #[track_caller]
    pub fn set_link(&self, index: usize, up: bool) {
        ip_ok(&["link", "set", &self.nodes[index].1, if up { "up" } else { "down" }]);
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for (namespace, outer) in self.nodes.drain(..) {
            // Deleting one end of a veth pair deletes both.
            if !outer.is_empty() {
                let _ = ip(&["link", "del", &outer]);
            }
            let _ = ip(&["netns", "del", &namespace]);
        }
        if let Some(bridge) = self.bridge.take() {
            let _ = ip(&["link", "del", &bridge]);
        }
    }
}

/// The IPv4 addresses configured on this namespace's interfaces.
fn addresses_in_use() -> Vec<String> {
    let output = Command::new("ip").args(["-o", "-4", "addr", "show"]).output();
    let text = output.map(|output| String::from_utf8_lossy(&output.stdout).into_owned());
    text.unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|word| *word == "inet")?;
            Some(words.next()?.split('/').next()?.to_owned())
        })
        .collect()
}

// ----- Nodes -----

/// One running `ferrite up` process of a [`ClusterNode`].
struct Process {
    child: Child,
    api_url: String,
    stdout: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
    stderr_thread: Option<std::thread::JoinHandle<()>>,
}

impl Process {
    fn pid(&self) -> libc::pid_t {
        libc::pid_t::try_from(self.child.id()).expect("PID fits pid_t")
    }

    fn stderr_now(&self) -> String {
        self.stderr.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Waits for the ended (or ending) process and collects what it printed.
    fn reap(mut self) -> Exit {
        let status = wait_with_timeout(&mut self.child, NODE_TIMEOUT).unwrap_or_else(|| {
            let _ = self.child.kill();
            self.child.wait().expect("wait for `ferrite up`")
        });
        if let Some(thread) = self.stderr_thread.take() {
            let _ = thread.join();
        }
        let stdout: Vec<String> = self.stdout.try_iter().collect();
        Exit { status, stdout, stderr: self.stderr_now() }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // Only this process, by its own handle (SIGKILL also ends a stopped process).
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A node of a [`Cluster`]: its fixed identity (name, data dir, NVMe address) and its current
/// process, if any.
pub struct ClusterNode {
    pub name: String,
    /// The address it serves NVMe/TCP, the API and replication on.
    pub ip: String,
    pub nvme_port: u16,
    /// The port it serves NBD on, at `ip`.
    pub nbd_port: u16,
    /// Its network namespace, with [`Network`].
    namespace: Option<String>,
    /// Everything after `ferrite up`, the same at every start.
    args: Vec<String>,
    process: Option<Process>,
    /// Stopped with SIGSTOP and not continued.
    paused: bool,
    /// Its link is down.
    cut: bool,
    /// The logs of its earlier processes, for the failure report and the ERROR-line check.
    earlier_stderr: String,
}

impl ClusterNode {
    /// Its `--data-dir`.
    pub fn data_dir(&self) -> std::path::PathBuf {
        let at = self.args.iter().position(|arg| arg == "--data-dir").expect("a --data-dir");
        std::path::PathBuf::from(&self.args[at + 1])
    }

    pub fn nvme_address(&self) -> String {
        format!("{}:{}", self.ip, self.nvme_port)
    }

    /// The NBD URI of `volume`'s export on this node.
    pub fn nbd_uri(&self, volume: &str) -> String {
        format!("nbd://{}:{}/{volume}", self.ip, self.nbd_port)
    }

    /// Whether its process runs, unpaused and connected.
    pub fn reachable(&self) -> bool {
        self.process.is_some() && !self.paused && !self.cut
    }

    /// The REST API URL of its running process.
    ///
    /// # Panics
    /// When it does not run.
    pub fn api_url(&self) -> &str {
        &self
            .process
            .as_ref()
            .unwrap_or_else(|| panic!("node {} is not running", self.name))
            .api_url
    }

    pub fn client(&self) -> api::Client {
        api::Client::new(self.api_url()).expect("an API client")
    }

    /// Every log line its processes wrote (earlier ones first).
    pub fn stderr_all(&self) -> String {
        let mut all = self.earlier_stderr.clone();
        if let Some(process) = &self.process {
            all.push_str(&process.stderr_now());
        }
        all
    }

    /// Starts its process, retrying while a port is still held by a killed predecessor.
    fn start(&mut self) {
        assert!(self.process.is_none(), "node {} already runs", self.name);
        for attempt in 1..=START_ATTEMPTS_MAX {
            match self.try_start() {
                Ok(process) => {
                    self.process = Some(process);
                    self.paused = false;
                    return;
                }
                Err(exit) => {
                    self.earlier_stderr.push_str(&exit.stderr);
                    // A port picked free was taken meanwhile (by another test, or by this
                    // node's own replication listener, which binds port 0).
                    let retry = exit.stderr.contains("cannot listen")
                        || exit.stderr.contains(" in use on ");
                    assert!(
                        retry && attempt < START_ATTEMPTS_MAX,
                        "`ferrite up` of node {} exited with {} before serving (attempt \
                         {attempt}); stderr:\n{}",
                        self.name,
                        exit.status,
                        exit.stderr
                    );
                    std::thread::sleep(START_RETRY_PAUSE);
                }
            }
        }
    }

    fn try_start(&self) -> Result<Process, Exit> {
        let mut command = match &self.namespace {
            Some(namespace) => {
                // `ip netns exec` enters the namespace and execs the node: the child's PID is
                // the node's.
                let mut command = Command::new("ip");
                command.args(["netns", "exec", namespace, FERRITE]);
                command
            }
            None => Command::new(FERRITE),
        };
        let mut child = command
            .arg("up")
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .die_with_test()
            .spawn()
            .expect("spawn `ferrite up`");
        let stdout = stdout_lines(&mut child);
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = BufReader::new(child.stderr.take().expect("piped stderr"));
        let sink = Arc::clone(&stderr);
        let stderr_thread = std::thread::spawn(move || {
            let mut line = Vec::new();
            while matches!(pipe.read_until(b'\n', &mut line), Ok(read) if read > 0) {
                sink.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push_str(&String::from_utf8_lossy(&line));
                line.clear();
            }
        });
        let mut process = Process {
            child,
            api_url: String::new(),
            stdout,
            stderr,
            stderr_thread: Some(stderr_thread),
        };
        let deadline = Instant::now() + NODE_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match process.stdout.recv_timeout(left) {
                Ok(line) if line.contains("REST API:") => {
                    process.api_url = line.split_whitespace().last().unwrap_or_default().to_owned();
                    break;
                }
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(process.reap()),
                Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                    "node {} printed no REST API line in {NODE_TIMEOUT:?}; stderr:\n{}",
                    self.name,
                    process.stderr_now()
                ),
            }
        }
        let client = api::Client::new(&process.api_url).expect("an API client");
        while let Err(error) = client.health() {
            assert!(
                Instant::now() < deadline,
                "node {}: /healthz never answered: {error}",
                self.name
            );
            std::thread::sleep(CONVERGE_POLL);
        }
        Ok(process)
    }

    fn signal(&self, signal: libc::c_int) {
        let process =
            self.process.as_ref().unwrap_or_else(|| panic!("node {} is not running", self.name));
        // SAFETY: kill(2) has no memory effects; the PID is our own child, not yet waited for,
        // so it cannot have been reused by another process.
        let sent = unsafe { libc::kill(process.pid(), signal) };
        assert_eq!(sent, 0, "kill({}, {signal}) failed", process.pid());
    }
}

/// What a cluster is made of.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub nodes: usize,
    /// `--rebuild-grace-s`; the node's default (600 s) when `None`.
    pub rebuild_grace_s: Option<u64>,
    /// Each node in its own network namespace ([`Network`]).
    pub namespaces: bool,
    /// More `ferrite up` arguments for every node, after the harness's own (say
    /// `--resync-mb-per-s 4`).
    pub up_args: Vec<String>,
    /// Where the nodes' data directories go (say a file system the test pauses); a temporary
    /// directory of the cluster's own when `None`.
    pub data_root: Option<std::path::PathBuf>,
}

impl ClusterOptions {
    pub fn nodes(nodes: usize) -> ClusterOptions {
        ClusterOptions {
            nodes,
            rebuild_grace_s: None,
            namespaces: false,
            up_args: Vec::new(),
            data_root: None,
        }
    }
}

/// etcd and the nodes of one cluster, all released on drop (see the module documentation).
pub struct Cluster {
    // Dropped in this order: the nodes, etcd, the network, the directories.
    nodes: Vec<ClusterNode>,
    etcd: Etcd,
    network: Option<Network>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts etcd and the nodes `node1`, `node2`, ... one after the other, and waits until
    /// every node is a live member.
    pub fn start(options: &ClusterOptions) -> Cluster {
        assert!((1..=CLUSTER_NODES_MAX).contains(&options.nodes), "{options:?}");
        let network = options.namespaces.then(|| Network::create(options.nodes));
        let etcd_ip = network.as_ref().map_or_else(|| "127.0.0.1".to_owned(), Network::bridge_ip);
        let etcd = Etcd::start(&etcd_ip);
        let dir = tempfile::tempdir().expect("a temporary directory for the nodes");
        let cluster_name = format!("test-{:08x}", rand::rng().random::<u32>());
        let mut cluster = Cluster { nodes: Vec::new(), etcd, network, _dir: dir };
        for index in 0..options.nodes {
            let name = format!("node{}", index + 1);
            let (ip, namespace) = match &cluster.network {
                Some(network) => {
                    (network.node_ip(index), Some(network.namespace(index).to_owned()))
                }
                None => ("127.0.0.1".to_owned(), None),
            };
            let root = options.data_root.as_deref().unwrap_or(cluster._dir.path());
            let data_dir = root.join(&name);
            let nvme_port = free_port();
            let nbd_port = free_port();
            let mut args: Vec<String> =
                vec!["--data-dir".to_owned(), data_dir.display().to_string()];
            args.extend(DRIVE_ARGS.iter().map(|arg| (*arg).to_owned()));
            for (option, value) in [
                ("--api-listen", format!("{ip}:0")),
                ("--nvme-listen", format!("{ip}:{nvme_port}")),
                ("--nbd-listen", format!("{ip}:{nbd_port}")),
                ("--cluster-etcd", cluster.etcd.client_url().to_owned()),
                ("--cluster-name", cluster_name.clone()),
                ("--node-name", name.clone()),
                ("--replication-listen", format!("{ip}:0")),
                ("--lease-ms", LEASE_MS.to_string()),
            ] {
                args.push(option.to_owned());
                args.push(value);
            }
            if let Some(grace_s) = options.rebuild_grace_s {
                args.push("--rebuild-grace-s".to_owned());
                args.push(grace_s.to_string());
            }
            args.extend(options.up_args.iter().cloned());
            let mut node = ClusterNode {
                name,
                ip,
                nvme_port,
                nbd_port,
                namespace,
                args,
                process: None,
                paused: false,
                cut: false,
                earlier_stderr: String::new(),
            };
            node.start();
            cluster.nodes.push(node);
        }
        let all: Vec<String> = cluster.nodes.iter().map(|node| node.name.clone()).collect();
        cluster.wait_cluster("every node live", |info| {
            let live: BTreeSet<&str> =
                info.nodes.iter().filter(|node| node.live).map(|node| node.name.as_str()).collect();
            all.iter().all(|name| live.contains(name.as_str()))
        });
        cluster
    }

    pub fn node(&self, index: usize) -> &ClusterNode {
        &self.nodes[index]
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The index of the node named `name`.
    #[track_caller]
    pub fn index(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node named {name:?}"))
    }

    /// Every node's NVMe/TCP address, in node order: the multipath hosts' paths.
    pub fn nvme_paths(&self) -> Vec<String> {
        self.nodes.iter().map(ClusterNode::nvme_address).collect()
    }

    /// A client of the first reachable node's API.
    #[track_caller]
    pub fn client(&self) -> api::Client {
        self.nodes
            .iter()
            .find(|node| node.reachable())
            .map(ClusterNode::client)
            .expect("a reachable node")
    }

    /// The first reachable node's API URL, for `ferrite` commands.
    #[track_caller]
    pub fn api_url(&self) -> String {
        let node = self.nodes.iter().find(|node| node.reachable()).expect("a reachable node");
        node.api_url().to_owned()
    }

    /// Kills node `index` with SIGKILL and waits for it to end. Its log is kept.
    pub fn kill9(&mut self, index: usize) -> Exit {
        let node = &mut self.nodes[index];
        node.signal(libc::SIGKILL);
        let process = node.process.take().expect("a running node");
        let exit = process.reap();
        node.earlier_stderr.push_str(&exit.stderr);
        node.paused = false;
        exit
    }

    /// Stops node `index` with SIGSTOP (frozen, its sockets open); returns once the kernel
    /// reports it stopped.
    pub fn pause(&mut self, index: usize) {
        let node = &mut self.nodes[index];
        node.signal(libc::SIGSTOP);
        node.paused = true;
        let pid = node.process.as_ref().expect("a running node").pid();
        let stat = format!("/proc/{pid}/stat");
        let deadline = Instant::now() + NODE_TIMEOUT;
        // The state is the field after the command name, which is in parentheses.
        while !std::fs::read_to_string(&stat).is_ok_and(|text| {
            text.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
        }) {
            assert!(Instant::now() < deadline, "node {} did not stop on SIGSTOP", node.name);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Continues node `index` after [`Cluster::pause`].
    pub fn resume(&mut self, index: usize) {
        self.nodes[index].signal(libc::SIGCONT);
        self.nodes[index].paused = false;
    }

    /// Brings node `index`'s network link down or up (needs [`ClusterOptions::namespaces`]).
    pub fn set_link(&mut self, index: usize, up: bool) {
        self.network.as_ref().expect("a cluster in network namespaces").set_link(index, up);
        self.nodes[index].cut = !up;
    }

    /// Starts node `index` again on its data dir, name and NVMe address.
    pub fn restart(&mut self, index: usize) {
        self.nodes[index].start();
    }

    /// `GET /v1/cluster` from the first reachable node that answers.
    pub fn cluster_info(&self) -> Option<api::ClusterInfo> {
        self.nodes
            .iter()
            .filter(|node| node.reachable())
            .find_map(|node| node.client().cluster().ok())
    }

    /// Waits until `done` holds of the cluster's view; panics with the last view after
    /// [`CONVERGE_TIMEOUT`].
    #[track_caller]
    pub fn wait_cluster(
        &self,
        what: &str,
        mut done: impl FnMut(&api::ClusterInfo) -> bool,
    ) -> api::ClusterInfo {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let info = self.cluster_info();
            if let Some(info) = info.as_ref().filter(|info| done(info)) {
                return info.clone();
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not reach \"{what}\" in {CONVERGE_TIMEOUT:?}; last view: {info:#?}"
            );
            std::thread::sleep(CONVERGE_POLL);
        }
    }

    /// The volume's replication as the first reachable node that answers reports it.
    pub fn replication(&self, volume: &str) -> Option<api::ReplicationInfo> {
        self.nodes
            .iter()
            .filter(|node| node.reachable())
            .find_map(|node| node.client().volume(volume).ok()?.replication)
    }

    /// The volume's replication as node `index` itself sees it (its `local` part is its own).
    pub fn replication_at(&self, index: usize, volume: &str) -> Option<api::ReplicationInfo> {
        self.nodes[index].client().volume(volume).ok()?.replication
    }

    /// Waits until `done` holds of the volume's replication state; panics with the last state
    /// after [`CONVERGE_TIMEOUT`].
    #[track_caller]
    pub fn wait_replication(
        &self,
        volume: &str,
        what: &str,
        mut done: impl FnMut(&api::ReplicationInfo) -> bool,
    ) -> api::ReplicationInfo {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let state = self.replication(volume);
            if let Some(state) = state.as_ref().filter(|state| done(state)) {
                return state.clone();
            }
            assert!(
                Instant::now() < deadline,
                "volume {volume} did not reach \"{what}\" in {CONVERGE_TIMEOUT:?}; last state: \
                 {state:#?}"
            );
            std::thread::sleep(CONVERGE_POLL);
        }
    }

    /// Waits until `done` holds of node `index`'s own replica of the volume (its counters are
    /// published a few times a second); panics with the last view after [`CONVERGE_TIMEOUT`].
    #[track_caller]
    pub fn wait_local(
        &self,
        index: usize,
        volume: &str,
        what: &str,
        mut done: impl FnMut(&api::LocalReplica) -> bool,
    ) -> api::LocalReplica {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let local = self.replication_at(index, volume).and_then(|state| state.local);
            if let Some(local) = local.as_ref().filter(|local| done(local)) {
                return local.clone();
            }
            assert!(
                Instant::now() < deadline,
                "{}'s replica of {volume} did not reach \"{what}\" in {CONVERGE_TIMEOUT:?}; last \
                 view: {local:#?}",
                self.nodes[index].name
            );
            std::thread::sleep(CONVERGE_POLL);
        }
    }

    /// Waits until the volume has a primary other than those in `not`, that serves it (as it
    /// says itself) in the store's epoch, with `in_sync` replicas in sync; returns that state.
    #[track_caller]
    pub fn wait_serving(&self, volume: &str, in_sync: usize, not: &[&str]) -> api::ReplicationInfo {
        let what = format!("served by a primary other than {not:?} with {in_sync} in sync");
        self.wait_replication(volume, &what, |state| {
            let Some(primary) = state.primary.as_deref() else { return false };
            if not.contains(&primary) || state.in_sync.len() != in_sync {
                return false;
            }
            let index = self.index(primary);
            self.nodes[index].reachable()
                && self.replication_at(index, volume).and_then(|own| own.local).is_some_and(
                    |local| local.serving && local.epoch == state.epoch && !local.failed,
                )
        })
    }

    /// Fails if a node logged an ERROR line other than those containing one of `expected`.
    #[track_caller]
    pub fn assert_no_error_lines(&self, expected: &[&str]) {
        for node in &self.nodes {
            super::assert_no_error_lines(&node.stderr_all(), expected, &node.name);
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "----- the last {ETCD_LOG_TAIL_LINES} log lines of etcd -----\n{}",
                self.etcd.log_tail()
            );
            for node in &self.nodes {
                eprintln!(
                    "----- the last {LOG_TAIL_LINES} log lines of {} ({}) -----\n{}",
                    node.name,
                    node.nvme_address(),
                    tail(&node.stderr_all(), LOG_TAIL_LINES)
                );
            }
        }
        // Kill the nodes before the network goes (the fields then drop in order).
        for node in &mut self.nodes {
            node.process = None;
        }
    }
}
