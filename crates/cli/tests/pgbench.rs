//! A real file system and database on a Ferrite volume: nbdfuse exposes the volume's NBD export
//! as a file, a loop device over it carries ext4, and PostgreSQL (the Debian build) runs pgbench
//! on it. Then PostgreSQL crashes (`pg_ctl stop -m immediate`), the file system is released and
//! the node is killed with SIGKILL and restarted on the same data dir. After that, ext4 must be
//! clean (`fsck.ext4 -n -f`), PostgreSQL must replay its WAL and hold exactly what it held at the
//! crash (every transaction pgbench saw commit is there), pgbench's invariant must hold (the
//! balances of accounts, tellers and branches and the deltas of the history sum to the same
//! number), `pg_amcheck` must find no corruption in tables or indexes, and pgbench must keep
//! working.
//!
//! Needs what the NBD file system test needs (root, /dev/fuse, `libnbd-bin`, `fuse3`) and the
//! PostgreSQL server (`postgresql-15`, which creates the `postgres` OS user that initdb runs as);
//! `scripts/deps.sh` installs them. A missing one fails the test: nothing is skipped.
//! PostgreSQL runs on a free port with its socket in a temp dir, so a system PostgreSQL on the
//! same machine is not disturbed.

mod common;

use common::{
    assert_no_error_lines, client, ferrite_ok, free_port, require_root_and_fuse, run, run_ok,
    FuseFile, LoopDevice, Mount, Node,
};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The volume holding the file system: thin, so only what ext4 and PostgreSQL write is stored.
const VOLUME: &str = "pg";
const VOLUME_SIZE: &str = "2G";
const VOLUME_BYTES: u64 = 2 << 30;
/// `pgbench -i -s PGBENCH_SCALE`: 100 000 accounts, 10 tellers and 1 branch per unit of scale.
const PGBENCH_SCALE: i64 = 2;
const ACCOUNTS_PER_SCALE: i64 = 100_000;
/// The load before the crash: clients, worker threads and seconds.
const PGBENCH_CLIENTS: &str = "4";
const PGBENCH_JOBS: &str = "2";
const PGBENCH_SECONDS: &str = "8";
/// The load after the restart, to show the database keeps working.
const PGBENCH_AFTER_SECONDS: &str = "3";
/// The OS user PostgreSQL runs as (initdb refuses root); the Debian package creates it.
const PG_OS_USER: &str = "postgres";
/// Where Debian installs each PostgreSQL major version: PG_ROOT/<major>/bin.
const PG_ROOT: &str = "/usr/lib/postgresql";
/// How long `pg_ctl` waits for a start (including WAL replay) or a stop.
const PG_CTL_TIMEOUT_S: &str = "120";

/// The newest PostgreSQL installed under [`PG_ROOT`] that has pgbench: its bin directory.
fn postgres_bin_dir() -> PathBuf {
    let newest = std::fs::read_dir(PG_ROOT)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let major: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("pgbench").is_file().then_some((major, bin))
        })
        .max_by_key(|(major, _)| *major);
    let Some((_, bin)) = newest else {
        panic!(
            "PostgreSQL is not installed (no {PG_ROOT}/<version>/bin/pgbench): install the \
             Debian package `postgresql-15` (scripts/deps.sh installs it) to run this test"
        )
    };
    bin
}

/// The numbers of a finished pgbench run.
#[derive(Debug)]
struct PgbenchRun {
    transactions: i64,
    /// The "latency average" and "tps" lines, as pgbench printed them.
    summary: String,
}

/// What the pgbench tables hold: the four sums of its invariant and the row counts.
#[derive(Debug, PartialEq, Eq)]
struct BankState {
    accounts_balance: i64,
    tellers_balance: i64,
    branches_balance: i64,
    history_delta: i64,
    accounts: i64,
    history_rows: i64,
}

impl BankState {
    /// Fails unless the balances of accounts, tellers and branches and the sum of the history's
    /// deltas are one number (every pgbench transaction adds its delta to one row of each), and
    /// unless no account went missing.
    #[track_caller]
    fn assert_consistent(&self, context: &str) {
        assert!(
            self.accounts_balance == self.branches_balance
                && self.tellers_balance == self.branches_balance
                && self.history_delta == self.branches_balance,
            "{context}: pgbench's invariant is broken: sum(abalance) {} sum(tbalance) {} \
             sum(bbalance) {} sum(delta) {} ({self:?})",
            self.accounts_balance,
            self.tellers_balance,
            self.branches_balance,
            self.history_delta
        );
        assert_eq!(
            self.accounts,
            PGBENCH_SCALE * ACCOUNTS_PER_SCALE,
            "{context}: pgbench_accounts holds {} rows, not {} ({self:?})",
            self.accounts,
            PGBENCH_SCALE * ACCOUNTS_PER_SCALE
        );
    }
}

/// A PostgreSQL cluster the test created, run by `pg_ctl` as [`PG_OS_USER`]. Dropped while
/// running, it is stopped with `pg_ctl stop -m immediate`, and if that fails its postmaster
/// (whose PID the start recorded: a process this test started) is killed.
struct Postgres {
    bin_dir: PathBuf,
    data_dir: PathBuf,
    /// Holds the unix socket and the server log; owned by [`PG_OS_USER`].
    run_dir: PathBuf,
    port: u16,
    postmaster_pid: Option<libc::pid_t>,
}

impl Postgres {
    /// The cluster in `data_dir`, listening on 127.0.0.1:`port` with its socket in `run_dir`;
    /// not started.
    fn new(bin_dir: &Path, data_dir: &Path, run_dir: &Path, port: u16) -> Postgres {
        Postgres {
            bin_dir: bin_dir.to_owned(),
            data_dir: data_dir.to_owned(),
            run_dir: run_dir.to_owned(),
            port,
            postmaster_pid: None,
        }
    }

    /// `initdb` on the data dir (created, and given to [`PG_OS_USER`] with the run dir), with
    /// the port and socket directory in its configuration.
    fn init(&self) {
        for dir in [&self.data_dir, &self.run_dir] {
            std::fs::create_dir_all(dir).expect("create a PostgreSQL directory");
            let mut command = client("chown", "coreutils");
            command.args([&format!("{PG_OS_USER}:"), path_str(dir)]);
            run_ok(command);
        }
        let mut command = self.tool("initdb");
        command.args(["-D", path_str(&self.data_dir), "-A", "trust", "-E", "UTF8", "--locale=C"]);
        run_ok(command);
        let settings = format!(
            "\n# Set by the Ferrite pgbench test.\nport = {}\nlisten_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\n",
            self.port,
            path_str(&self.run_dir)
        );
        let config = self.data_dir.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&config).expect("read postgresql.conf");
        text.push_str(&settings);
        std::fs::write(&config, text).expect("write postgresql.conf");
    }

    /// A PostgreSQL program run as [`PG_OS_USER`], from a directory that user can enter.
    fn tool(&self, program: &str) -> Command {
        let path = self.bin_dir.join(program);
        assert!(path.is_file(), "{} is missing from the PostgreSQL installation", path.display());
        let mut command = client("runuser", "util-linux");
        command.args(["-u", PG_OS_USER, "--"]).arg(path).current_dir(&self.run_dir);
        command
    }

    /// A client program connected to this cluster's `postgres` database over its socket.
    fn client_tool(&self, program: &str) -> Command {
        let mut command = self.tool(program);
        command.args(["-h", path_str(&self.run_dir), "-p", &self.port.to_string()]);
        command
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.run_dir.join("server.log")).unwrap_or_default()
    }

    /// Starts the server and waits until it accepts connections (after any WAL replay).
    fn start(&mut self) {
        assert!(self.postmaster_pid.is_none(), "PostgreSQL is already running");
        let mut command = self.tool("pg_ctl");
        command.args(["start", "-w", "-t", PG_CTL_TIMEOUT_S, "-D", path_str(&self.data_dir)]);
        command.args(["-l", path_str(&self.run_dir.join("server.log"))]);
        let finished = run(command);
        assert!(
            finished.status.success(),
            "pg_ctl start failed ({}):\n{}\nserver log:\n{}",
            finished.status,
            finished.text,
            self.log()
        );
        let pid_file = std::fs::read_to_string(self.data_dir.join("postmaster.pid"))
            .expect("read postmaster.pid");
        let pid = pid_file.lines().next().and_then(|line| line.trim().parse().ok());
        assert!(pid.is_some_and(|pid: libc::pid_t| pid > 1), "postmaster.pid: {pid_file:?}");
        self.postmaster_pid = pid;
    }

    /// `pg_ctl stop -m MODE`: `immediate` is a crash (no checkpoint; the next start replays
    /// the WAL), `fast` a clean shutdown.
    fn stop(&mut self, mode: &str) {
        let mut command = self.tool("pg_ctl");
        command.args(["stop", "-w", "-t", PG_CTL_TIMEOUT_S, "-m", mode]);
        command.args(["-D", path_str(&self.data_dir)]);
        let finished = run(command);
        assert!(
            finished.status.success(),
            "pg_ctl stop -m {mode} failed ({}):\n{}\nserver log:\n{}",
            finished.status,
            finished.text,
            self.log()
        );
        self.postmaster_pid = None;
    }

    /// Runs one SQL statement in `psql` and returns its unaligned output.
    #[track_caller]
    fn sql(&self, statement: &str) -> String {
        let mut command = self.client_tool("psql");
        command.args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", "postgres", "-c"]);
        command.arg(statement);
        let finished = run(command);
        assert!(
            finished.status.success(),
            "psql -c {statement:?} failed ({}):\n{}",
            finished.status,
            finished.text
        );
        finished.stdout.trim().to_owned()
    }

    /// Runs pgbench with `args` on the `postgres` database.
    #[track_caller]
    fn pgbench(&self, args: &[&str]) -> PgbenchRun {
        let mut command = self.client_tool("pgbench");
        command.args(args).arg("postgres");
        let text = run_ok(command);
        let field = |label: &str| {
            text.lines().find_map(|line| line.trim().strip_prefix(label).map(str::trim))
        };
        let transactions = field("number of transactions actually processed:")
            .and_then(|value| value.split('/').next()?.trim().parse().ok())
            .unwrap_or(0);
        let summary = text
            .lines()
            .filter(|line| line.starts_with("latency average") || line.starts_with("tps ="))
            .collect::<Vec<_>>()
            .join("; ");
        PgbenchRun { transactions, summary }
    }

    /// The sums and counts of the pgbench tables.
    #[track_caller]
    fn bank_state(&self) -> BankState {
        let row = self.sql(
            "SELECT (SELECT coalesce(sum(abalance), 0) FROM pgbench_accounts), \
                    (SELECT coalesce(sum(tbalance), 0) FROM pgbench_tellers), \
                    (SELECT coalesce(sum(bbalance), 0) FROM pgbench_branches), \
                    (SELECT coalesce(sum(delta), 0) FROM pgbench_history), \
                    (SELECT count(*) FROM pgbench_accounts), \
                    (SELECT count(*) FROM pgbench_history)",
        );
        let numbers: Vec<i64> = row
            .split('|')
            .map(|field| field.parse().unwrap_or_else(|_| panic!("not a number in {row:?}")))
            .collect();
        let [accounts_balance, tellers_balance, branches_balance, history_delta, accounts, history_rows] =
            numbers[..]
        else {
            panic!("expected six numbers, psql printed {row:?}")
        };
        BankState {
            accounts_balance,
            tellers_balance,
            branches_balance,
            history_delta,
            accounts,
            history_rows,
        }
    }

    /// `pg_amcheck` over every database (installing the amcheck extension where missing),
    /// checking each table's pages and that every index matches its table.
    #[track_caller]
    fn amcheck(&self) {
        let mut command = self.client_tool("pg_amcheck");
        command.args(["--all", "--install-missing", "--heapallindexed", "--progress"]);
        let finished = run(command);
        assert!(
            finished.status.success(),
            "pg_amcheck found corruption or failed ({}):\n{}",
            finished.status,
            finished.text
        );
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let Some(pid) = self.postmaster_pid.take() else { return };
        let stopped = self
            .tool("pg_ctl")
            .args(["stop", "-w", "-t", "30", "-m", "immediate", "-D", path_str(&self.data_dir)])
            .status()
            .is_ok_and(|status| status.success());
        if !stopped {
            eprintln!("pg_ctl stop failed; killing the postmaster {pid} this test started");
            // SAFETY: kill(2) has no memory effects; `pid` is the postmaster this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("UTF-8 temp path")
}

/// The volume's file system: an nbdfuse file, a loop device over it and ext4 mounted on it.
/// Declared in this order so that, dropped on a failure, they are released mount first.
struct FileSystem {
    mount: Mount,
    device: LoopDevice,
    fuse: FuseFile,
}

impl FileSystem {
    /// Attaches the volume's export; with `make`, makes ext4 on it, otherwise requires that
    /// `fsck.ext4 -n -f` finds the existing one clean. Then mounts it on `mount_dir`.
    fn attach(node: &Node, dir: &Path, make: bool) -> FileSystem {
        let fuse = FuseFile::start(&dir.join("fuse"), VOLUME, &node.nbd_uri(VOLUME), VOLUME_BYTES);
        let device = LoopDevice::attach(&fuse.file);
        let mut command = if make {
            let mut command = client("mkfs.ext4", "e2fsprogs");
            command.args(["-q", "-F", device.path()]);
            command
        } else {
            let mut command = client("fsck.ext4", "e2fsprogs");
            command.args(["-n", "-f", device.path()]);
            command
        };
        command.env("LC_ALL", "C");
        run_ok(command);
        let mount = Mount::at(device.path(), &mount_dir(dir));
        FileSystem { mount, device, fuse }
    }

    fn release(self) {
        let FileSystem { mount, device, fuse } = self;
        mount.unmount();
        device.detach();
        fuse.stop();
    }
}

fn mount_dir(dir: &Path) -> PathBuf {
    dir.join("mnt")
}

#[test]
fn pgbench_on_ext4_survives_a_crash_of_postgres_and_sigkill_of_the_node() {
    let started = Instant::now();
    require_root_and_fuse();
    let bin_dir = postgres_bin_dir();
    let mut command = client("id", "coreutils");
    command.arg(PG_OS_USER);
    let user = run(command);
    assert!(
        user.status.success(),
        "there is no `{PG_OS_USER}` OS user: the Debian package `postgresql-15` creates it \
         (scripts/deps.sh installs it)"
    );

    let temp = tempfile::tempdir().expect("temp dir");
    let dir = temp.path();
    // The PostgreSQL user must reach its data (on the mount) and its socket, both in here.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod temp");
    let data_dir = dir.join("data");
    let pg_data = mount_dir(dir).join("pgdata");
    let pg_run = dir.join("pg-run");
    let nvme_port = free_port();
    let pg_port = free_port();

    let node = Node::start(&data_dir, nvme_port);
    ferrite_ok(&node.api_url, &["volume", "create", VOLUME, "--size", VOLUME_SIZE]);
    let fs = FileSystem::attach(&node, dir, true);
    let mut postgres = Postgres::new(&bin_dir, &pg_data, &pg_run, pg_port);
    postgres.init();
    postgres.start();
    postgres.pgbench(&["-i", "-q", "-s", &PGBENCH_SCALE.to_string()]);
    let load =
        postgres.pgbench(&["-n", "-c", PGBENCH_CLIENTS, "-j", PGBENCH_JOBS, "-T", PGBENCH_SECONDS]);
    eprintln!("pgbench before the crash: {} transactions; {}", load.transactions, load.summary);
    assert!(load.transactions > 0, "pgbench committed no transaction: {load:?}");
    let at_crash = postgres.bank_state();
    at_crash.assert_consistent("before the crash");
    assert!(
        at_crash.history_rows >= load.transactions,
        "pgbench reported {} committed transactions but the history holds {} rows",
        load.transactions,
        at_crash.history_rows
    );

    // A crash of PostgreSQL, then of the node, with the file system released in between.
    postgres.stop("immediate");
    fs.release();
    let killed = node.signal_and_wait(libc::SIGKILL);
    assert_eq!(
        killed.status.signal(),
        Some(libc::SIGKILL),
        "the node did not die of SIGKILL: {}",
        killed.status
    );
    assert_no_error_lines(&killed.stderr, &[], "the node before SIGKILL");

    let node = Node::start(&data_dir, nvme_port);
    let fs = FileSystem::attach(&node, dir, false);
    // A new guard, declared after this file system, so that a failure stops PostgreSQL first.
    let mut postgres = Postgres::new(&bin_dir, &pg_data, &pg_run, pg_port);
    postgres.start();
    let log = postgres.log();
    assert!(
        log.contains("automatic recovery in progress") && log.contains("redo done"),
        "PostgreSQL did not replay its WAL after the crash; server log:\n{log}"
    );
    let recovered = postgres.bank_state();
    assert_eq!(
        recovered, at_crash,
        "the database after WAL replay differs from the database at the crash"
    );
    recovered.assert_consistent("after the restart");
    postgres.amcheck();

    let after = postgres.pgbench(&[
        "-n",
        "-c",
        PGBENCH_CLIENTS,
        "-j",
        PGBENCH_JOBS,
        "-T",
        PGBENCH_AFTER_SECONDS,
    ]);
    eprintln!("pgbench after the restart: {} transactions; {}", after.transactions, after.summary);
    assert!(after.transactions > 0, "pgbench committed no transaction after the restart");
    let end = postgres.bank_state();
    end.assert_consistent("after pgbench ran again");
    assert!(
        end.history_rows >= recovered.history_rows + after.transactions,
        "history rows {} after {} more transactions on {}",
        end.history_rows,
        after.transactions,
        recovered.history_rows
    );

    postgres.stop("fast");
    fs.release();
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "after the restart");
    eprintln!("pgbench test took {:?}", started.elapsed());
}
