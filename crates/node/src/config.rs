//! A node's configuration: where its data lives, its drives, and the addresses it serves.
//!
//! Drive geometry is chosen once, on the node's first start, and recorded in the metadata store;
//! on later starts the recorded geometry wins, and asking for a different one is an error
//! rather than a silent reformat.
//!
//! The drives are either files the node creates in DATA-DIR/drives, or block devices (or
//! existing files) the operator names with `--drive` ([`NodeConfig::drives`]); the node record
//! remembers which, and external drives are recognised by their superblocks, not their paths.
//!
//! Erasure coding (`--erasure-coding k+m`) is chosen on the first start too, and written into
//! every drive's log superblock by the engine: that is where later starts find it (a differing
//! request is refused, see `crate::NodeError::ErasureChanged`). Without a request a node gets
//! `engine::erasure::ErasureScheme::for_drives`'s default for its drive count.
//!
//! The drive backend ([`DriveBackend`]) says what holds the drives' bytes: files (durable) or
//! RAM (NOT DURABLE, for measuring the target without a drive in the way). Memory drives must
//! fit in RAM with room to spare ([`NodeConfig::check_memory_drives`]).

use engine::erasure::ErasureScheme;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use types::ByteSize;

/// The data dir `ferrite up` uses when none is given, relative to the working directory.
pub const DEFAULT_DATA_DIR: &str = "ferrite-data";
/// Drives created on a first start when no count is given: enough to stripe over, laptop-sized.
pub const DEFAULT_DRIVE_COUNT: u16 = 4;
/// The size of each drive file on a first start when none is given. Files are sparse, so this
/// costs disk space only as data is written.
pub const DEFAULT_DRIVE_SIZE_BYTES: u64 = 16 << 30;
pub const DEFAULT_NVME_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 4420));
pub const DEFAULT_API_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8080));
/// NBD's IANA port, on loopback.
pub const DEFAULT_NBD_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10809));

pub const DRIVE_COUNT_MAX: u16 = 64;
pub const DRIVE_SIZE_BYTES_MIN: u64 = 64 << 20;
pub const DRIVE_SIZE_BYTES_MAX: u64 = 1 << 50;
/// Drive sizes are whole mebibytes, so every chunk size the engine may pick divides them evenly
/// enough and offsets stay aligned for O_DIRECT.
pub const DRIVE_SIZE_ALIGNMENT_BYTES: u64 = 1 << 20;
/// The directory under the data dir that holds the drive files.
pub const DRIVES_DIR_NAME: &str = "drives";
/// The size of each memory drive when none is given: 4 drives take at most 4 GiB of RAM, and
/// only as volumes are written (memory drives are sparse too).
pub const DEFAULT_MEMORY_DRIVE_SIZE_BYTES: u64 = 1 << 30;
/// Memory drives may promise at most this share of the RAM available at start (MemAvailable in
/// /proc/meminfo), so that filling them cannot push the machine into the OOM killer.
pub const MEMORY_DRIVES_AVAILABLE_PERCENT_MAX: u64 = 75;

/// What holds the drives' bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DriveBackend {
    /// Sparse drive files in DATA-DIR/drives, written with O_DIRECT: durable.
    #[default]
    File,
    /// Anonymous memory files (`io::MemoryDrives`) that live as long as the node's process:
    /// NOT DURABLE. The node keeps its metadata in a fresh scratch directory, removed when it
    /// stops, so a restart starts empty instead of finding volumes whose data is gone.
    Memory,
}

impl DriveBackend {
    /// The name users see: in `--drive-backend`, the node API and the metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Memory => "memory",
        }
    }

    /// The size of each drive on a first start when none is given.
    pub fn default_drive_size_bytes(self) -> u64 {
        match self {
            Self::File => DEFAULT_DRIVE_SIZE_BYTES,
            Self::Memory => DEFAULT_MEMORY_DRIVE_SIZE_BYTES,
        }
    }
}

/// Everything a node needs to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    /// Drives to create on the first start; `None` means [`DEFAULT_DRIVE_COUNT`]. On later
    /// starts it must be `None` or the recorded count.
    pub drive_count: Option<u16>,
    /// Size of each drive on the first start; `None` means [`DEFAULT_DRIVE_SIZE_BYTES`]. On
    /// later starts it must be `None` or the recorded size.
    pub drive_size_bytes: Option<u64>,
    /// External drives (`--drive`): block devices or existing regular files used as the
    /// node's drives instead of files in DATA-DIR/drives. On the first start they are
    /// formatted, drive `i` being `drives[i]`; later starts must name the same drives, in any
    /// order. Empty for drive files. Not with `drive_count` or `drive_size_bytes`.
    pub drives: Vec<PathBuf>,
    /// On the first start, write zeros over each drive file in DATA-DIR/drives (after
    /// creating it sparse), so the filesystem allocates every block then instead of on the
    /// log's first pass over it, where each allocation adds a metadata update (a journal commit
    /// on a journalled filesystem) to a durable write (see `io::lay_out_drive_file`). Drive
    /// files only: not with `drives` or memory.
    pub lay_out_drives: bool,
    /// Addresses to serve NVMe/TCP on: each is an NVMe port (IDs 1, 2, ... in this order).
    pub nvme_listen: Vec<SocketAddr>,
    /// Address to serve NBD on (every volume open to any host is an export); `None` serves no
    /// NBD (`--nbd-listen off`).
    pub nbd_listen: Option<SocketAddr>,
    pub api_listen: SocketAddr,
    /// Stop when the process receives SIGINT (Ctrl-C) or SIGTERM. The `ferrite up` binary sets
    /// this; tests that run nodes in-process leave it off.
    pub stop_on_signals: bool,
    /// Data-path threads serving NVMe/TCP and NBD; 0 takes the default
    /// ([`NodeConfig::data_threads_default`]): one per CPU on a single node, one on a cluster
    /// node.
    pub data_threads: usize,
    /// Busy-poll window of each data-path thread after the last received bytes, in
    /// microseconds; 0 never polls (see `nvme::Poller`).
    pub poll_us: u64,
    /// Read-triggered defragmentation: a multi-block read of blocks scattered over the log
    /// has them rewritten back to back (see `engine::log`'s `defrag`). `None`: on (on cluster
    /// nodes too since their reads stopped going through the replication service's thread:
    /// docs/BENCHMARKS.md, session 15).
    pub read_defrag: Option<bool>,
    /// The most the background scrub reads, in MiB per second; 0 runs no scrub (see
    /// `crate::scrub`).
    pub scrub_mb_per_s: u64,
    /// The erasure coding to format the drives with on the first start
    /// ([`parse_erasure_coding`]); `None` takes the default for the drive count. On later
    /// starts it must be `None` or what the drives were formatted with.
    pub erasure_coding: Option<ErasureScheme>,
    /// The most a drive rebuild writes, in MiB per second; 0 sets no limit (see
    /// `crate::rebuild`).
    pub rebuild_mb_per_s: u64,
    /// Join a cluster (`--cluster-etcd`): volumes are replicated across its nodes. `None`: a
    /// single node with its embedded metadata store.
    pub cluster: Option<crate::cluster::ClusterConfig>,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            drive_count: None,
            drive_size_bytes: None,
            drives: Vec::new(),
            lay_out_drives: false,
            nvme_listen: vec![DEFAULT_NVME_LISTEN],
            nbd_listen: Some(DEFAULT_NBD_LISTEN),
            api_listen: DEFAULT_API_LISTEN,
            stop_on_signals: false,
            data_threads: 0,
            poll_us: 0,
            read_defrag: None,
            scrub_mb_per_s: crate::scrub::DEFAULT_SCRUB_MB_PER_S,
            erasure_coding: None,
            rebuild_mb_per_s: crate::rebuild::DEFAULT_REBUILD_MB_PER_S,
            cluster: None,
        }
    }
}

/// Parses `--erasure-coding`: `k+m` (such as `4+1`: 4 data and 1 parity block per stripe, each
/// on its own drive) or `none` (no parity, the same as `1+0`).
pub fn parse_erasure_coding(text: &str) -> Result<ErasureScheme, ConfigError> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("none") {
        return Ok(ErasureScheme::NONE);
    }
    let scheme: ErasureScheme = text.parse().map_err(|error: engine::erasure::ErasureError| {
        ConfigError::ErasureCoding { text: text.to_owned(), reason: error.to_string() }
    })?;
    if scheme.parity_shards() == 0 && scheme != ErasureScheme::NONE {
        return Err(ConfigError::ErasureCoding {
            text: text.to_owned(),
            reason: "a scheme without parity blocks is `none`".to_owned(),
        });
    }
    Ok(scheme)
}

/// The scheme a new node of `drive_count` drives is formatted with, given what was asked for,
/// and a sentence to log when it differs from the request (or from the default).
pub fn resolve_erasure(
    requested: Option<ErasureScheme>,
    drive_count: u16,
) -> (ErasureScheme, Option<String>) {
    let request = requested.map(|scheme| (scheme.data_shards(), scheme.parity_shards()));
    match ErasureScheme::for_drives(drive_count, request) {
        Ok(resolved) => resolved,
        // Unreachable for a parsed scheme (`for_drives` only refuses invalid ones); no parity
        // is the safe reading of a request it cannot place.
        Err(error) => (ErasureScheme::NONE, Some(format!("{error}; using none"))),
    }
}

/// A configuration value out of bounds. The message names the flag to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("--drives {0} is out of range: give 1 to {DRIVE_COUNT_MAX} drives")]
    DriveCount(u16),
    #[error(
        "--drive-size {} is out of range: give a whole number of MiB from {} to {}",
        ByteSize(*.0), ByteSize(DRIVE_SIZE_BYTES_MIN), ByteSize(DRIVE_SIZE_BYTES_MAX)
    )]
    DriveSize(u64),
    #[error(
        "memory drives of {} ({drive_count} x {}) do not fit in RAM: at most \
         {MEMORY_DRIVES_AVAILABLE_PERCENT_MAX}% of the {:.1} GiB available (MemAvailable) may \
         be promised to them; give a smaller --drive-size or fewer --drives",
        ByteSize(drive_count.saturating_mul(*drive_size_bytes)), ByteSize(*drive_size_bytes),
        *available_bytes as f64 / f64::from(1u32 << 30)
    )]
    MemoryDrivesTooLarge { drive_count: u64, drive_size_bytes: u64, available_bytes: u64 },
    #[error("--drive is given {0} times: give 1 to {DRIVE_COUNT_MAX} drives")]
    DrivePathCount(usize),
    #[error(
        "--drives and --drive-size cannot be used with --drive: the drives given with --drive \
         are the node's drives, and their size is the smallest one's"
    )]
    DrivePathsWithGeometry,
    #[error(
        "--poll-us {0} is out of range: give 0 (never poll) to {max} microseconds",
        max = crate::nvme::POLL_US_MAX
    )]
    PollWindow(u64),
    #[error(
        "--scrub-mb-per-s {0} is out of range: give 0 (no scrub) to {max} MiB per second",
        max = crate::scrub::SCRUB_MB_PER_S_MAX
    )]
    ScrubRate(u64),
    #[error(
        "--rebuild-mb-per-s {0} is out of range: give 0 (no limit) to {max} MiB per second",
        max = crate::rebuild::REBUILD_MB_PER_S_MAX
    )]
    RebuildRate(u64),
    #[error(
        "--erasure-coding {text:?} is not a scheme: {reason}; give k+m (k data and m parity \
         blocks per stripe, such as 4+1 or 2+1) or none"
    )]
    ErasureCoding { text: String, reason: String },
    #[error(
        "--lay-out-drives applies to the drive files Ferrite creates in DATA-DIR/drives, not to \
         drives given with --drive (a block device needs no lay-out; lay out a file you give \
         yourself with fallocate or dd before the first start)"
    )]
    LayOutExternalDrives,
}

impl NodeConfig {
    /// The data-path threads a node starts with `data_threads` of 0, given the CPUs it may
    /// use. A cluster node takes one: every I/O of its volumes goes through the replication
    /// service, a task on data-path thread 0, so a host connection served on another thread
    /// hands every command across threads and back (two wake-ups of a sleeping thread). On
    /// this project's 2-vCPU machine, three nodes with three copies spent 8-14% less server CPU
    /// per I/O with one thread each than with two (docs/BENCHMARKS.md, session 20).
    pub fn data_threads_default(&self, cpus: usize) -> usize {
        if self.cluster.is_some() {
            1
        } else {
            cpus.max(1)
        }
    }

    /// The data-path threads to start: `data_threads`, or the default for 0.
    pub fn data_threads_resolved(&self, cpus: usize) -> usize {
        if self.data_threads == 0 {
            self.data_threads_default(cpus)
        } else {
            self.data_threads
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.drives.is_empty() {
            if self.drives.len() > usize::from(DRIVE_COUNT_MAX) {
                return Err(ConfigError::DrivePathCount(self.drives.len()));
            }
            if self.drive_count.is_some() || self.drive_size_bytes.is_some() {
                return Err(ConfigError::DrivePathsWithGeometry);
            }
            if self.lay_out_drives {
                return Err(ConfigError::LayOutExternalDrives);
            }
        }
        if self.poll_us > crate::nvme::POLL_US_MAX {
            return Err(ConfigError::PollWindow(self.poll_us));
        }
        if self.scrub_mb_per_s > crate::scrub::SCRUB_MB_PER_S_MAX {
            return Err(ConfigError::ScrubRate(self.scrub_mb_per_s));
        }
        if self.rebuild_mb_per_s > crate::rebuild::REBUILD_MB_PER_S_MAX {
            return Err(ConfigError::RebuildRate(self.rebuild_mb_per_s));
        }
        if let Some(count) = self.drive_count {
            if !(1..=DRIVE_COUNT_MAX).contains(&count) {
                return Err(ConfigError::DriveCount(count));
            }
        }
        if let Some(size_bytes) = self.drive_size_bytes {
            let valid = (DRIVE_SIZE_BYTES_MIN..=DRIVE_SIZE_BYTES_MAX).contains(&size_bytes)
                && size_bytes % DRIVE_SIZE_ALIGNMENT_BYTES == 0;
            if !valid {
                return Err(ConfigError::DriveSize(size_bytes));
            }
        }
        Ok(())
    }

    /// Checks that memory drives of this configuration fit in `available_bytes` of RAM (at most
    /// [`MEMORY_DRIVES_AVAILABLE_PERCENT_MAX`] percent of it). Call after [`Self::validate`].
    pub fn check_memory_drives(&self, available_bytes: u64) -> Result<(), ConfigError> {
        let drive_count = u64::from(self.drive_count.unwrap_or(DEFAULT_DRIVE_COUNT));
        let drive_size_bytes =
            self.drive_size_bytes.unwrap_or(DriveBackend::Memory.default_drive_size_bytes());
        // Validated sizes (at most 64 drives of 1 PiB) and RAM sizes cannot overflow u128.
        let promised = u128::from(drive_count) * u128::from(drive_size_bytes) * 100;
        let allowed = u128::from(available_bytes) * u128::from(MEMORY_DRIVES_AVAILABLE_PERCENT_MAX);
        if promised > allowed {
            return Err(ConfigError::MemoryDrivesTooLarge {
                drive_count,
                drive_size_bytes,
                available_bytes,
            });
        }
        Ok(())
    }

    /// `DATA-DIR/drives`.
    pub fn drives_dir(&self) -> PathBuf {
        self.data_dir.join(DRIVES_DIR_NAME)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fit_a_laptop() {
        let config = NodeConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.api_listen.to_string(), "127.0.0.1:8080");
        assert_eq!(config.nvme_listen, vec![DEFAULT_NVME_LISTEN]);
        assert_eq!(DEFAULT_NVME_LISTEN.to_string(), "127.0.0.1:4420");
        assert_eq!(
            config.nbd_listen.map(|addr| addr.to_string()).as_deref(),
            Some("127.0.0.1:10809")
        );
        assert_eq!(config.drives_dir(), PathBuf::from("ferrite-data/drives"));
    }

    #[test]
    fn a_cluster_node_serves_on_the_replication_services_thread_unless_told_otherwise() {
        let single = NodeConfig::default();
        assert_eq!(single.data_threads_resolved(8), 8);
        assert_eq!(single.data_threads_resolved(0), 1);
        let cluster = NodeConfig {
            cluster: Some(crate::cluster::ClusterConfig {
                etcd_endpoints: vec!["http://127.0.0.1:2379".to_owned()],
                name: "c".to_owned(),
                node_name: "n1".to_owned(),
                replication_listen: "127.0.0.1:0".parse().expect("address"),
                labels: std::collections::BTreeMap::new(),
                lease_ms: 2_000,
                rebuild_grace_s: 60,
                resync_mb_per_s: 100,
                etcd_wait_s: 0,
                unnamed_data_grace_s: crate::cluster::DEFAULT_UNNAMED_DATA_GRACE_S,
            }),
            ..NodeConfig::default()
        };
        assert_eq!(cluster.data_threads_resolved(8), 1);
        // A count given by hand is kept on either kind of node.
        assert_eq!(NodeConfig { data_threads: 3, ..cluster }.data_threads_resolved(8), 3);
        assert_eq!(NodeConfig { data_threads: 3, ..single }.data_threads_resolved(8), 3);
    }

    #[test]
    fn bounds() {
        let check = |drive_count: Option<u16>, drive_size_bytes: Option<u64>, valid: bool| {
            let config = NodeConfig { drive_count, drive_size_bytes, ..NodeConfig::default() };
            assert_eq!(config.validate().is_ok(), valid, "{drive_count:?} {drive_size_bytes:?}");
        };
        check(Some(1), Some(DRIVE_SIZE_BYTES_MIN), true);
        check(Some(DRIVE_COUNT_MAX), Some(1 << 40), true);
        check(Some(0), None, false);
        check(Some(DRIVE_COUNT_MAX + 1), None, false);
        check(None, Some(DRIVE_SIZE_BYTES_MIN - (1 << 20)), false);
        check(None, Some((1 << 30) + 4096), false);
        let message = ConfigError::DriveSize(1000).to_string();
        assert!(message.contains("64MiB"), "{message}");
    }

    #[test]
    fn drive_paths() {
        let check = |count: usize, drive_count: Option<u16>, expect: Result<(), ConfigError>| {
            let drives =
                (0..count).map(|index| PathBuf::from(format!("/dev/loop{index}"))).collect();
            let config = NodeConfig { drives, drive_count, ..NodeConfig::default() };
            assert_eq!(config.validate(), expect, "{count} {drive_count:?}");
        };
        check(1, None, Ok(()));
        check(usize::from(DRIVE_COUNT_MAX), None, Ok(()));
        check(usize::from(DRIVE_COUNT_MAX) + 1, None, Err(ConfigError::DrivePathCount(65)));
        check(2, Some(2), Err(ConfigError::DrivePathsWithGeometry));
    }

    #[test]
    fn poll_window_is_bounded() {
        let check = |poll_us| NodeConfig { poll_us, ..NodeConfig::default() }.validate();
        assert_eq!(check(0), Ok(()));
        assert_eq!(check(crate::nvme::POLL_US_MAX), Ok(()));
        let over = crate::nvme::POLL_US_MAX + 1;
        assert_eq!(check(over), Err(ConfigError::PollWindow(over)));
        assert!(check(over).unwrap_err().to_string().contains("--poll-us"));
    }

    #[test]
    fn scrub_rate_is_bounded() {
        let check =
            |scrub_mb_per_s| NodeConfig { scrub_mb_per_s, ..NodeConfig::default() }.validate();
        assert_eq!(NodeConfig::default().scrub_mb_per_s, crate::scrub::DEFAULT_SCRUB_MB_PER_S);
        assert_eq!(check(0), Ok(()));
        assert_eq!(check(crate::scrub::SCRUB_MB_PER_S_MAX), Ok(()));
        let over = crate::scrub::SCRUB_MB_PER_S_MAX + 1;
        assert_eq!(check(over), Err(ConfigError::ScrubRate(over)));
        assert!(check(over).unwrap_err().to_string().contains("--scrub-mb-per-s"));
    }

    #[test]
    fn erasure_coding_is_parsed_and_resolved() {
        let parse = |text: &str| parse_erasure_coding(text).map(|scheme| scheme.to_string());
        assert_eq!(parse("4+1").as_deref(), Ok("4+1"));
        assert_eq!(parse(" 2+2 ").as_deref(), Ok("2+2"));
        assert_eq!(parse("none").as_deref(), Ok("1+0"));
        assert_eq!(parse("1+0").as_deref(), Ok("1+0"));
        for bad in ["3+0", "4", "four+1", "0+1", "4+9", ""] {
            let error = parse_erasure_coding(bad).unwrap_err().to_string();
            assert!(error.contains("--erasure-coding") && error.contains("k+m"), "{error}");
        }
        let resolve = |requested: Option<&str>, drives: u16| {
            let requested = requested.map(|text| parse_erasure_coding(text).unwrap());
            let (scheme, note) = resolve_erasure(requested, drives);
            (scheme.to_string(), note.is_some())
        };
        assert_eq!(resolve(None, 5), ("4+1".to_owned(), false));
        assert_eq!(resolve(None, 4), ("3+1".to_owned(), true));
        assert_eq!(resolve(None, 2), ("1+1".to_owned(), true));
        assert_eq!(resolve(None, 1), ("1+0".to_owned(), true));
        assert_eq!(resolve(Some("2+1"), 3), ("2+1".to_owned(), false));
        assert_eq!(resolve(Some("4+1"), 3), ("2+1".to_owned(), true));
        assert_eq!(resolve(Some("none"), 4), ("1+0".to_owned(), false));
        let rate = |rebuild_mb_per_s| NodeConfig { rebuild_mb_per_s, ..NodeConfig::default() };
        assert_eq!(rate(0).validate(), Ok(()));
        let over = crate::rebuild::REBUILD_MB_PER_S_MAX + 1;
        assert_eq!(rate(over).validate(), Err(ConfigError::RebuildRate(over)));
    }

    #[test]
    fn memory_drives_must_fit_in_ram() {
        const GIB: u64 = 1 << 30;
        let check = |drive_count: Option<u16>, drive_size_bytes: Option<u64>, available: u64| {
            let config = NodeConfig { drive_count, drive_size_bytes, ..NodeConfig::default() };
            config.check_memory_drives(available)
        };
        // The defaults, 4 x 1 GiB, need 4 GiB / 75% = 5.33 GiB available.
        assert_eq!(check(None, None, 6 * GIB), Ok(()));
        assert!(check(None, None, 5 * GIB).is_err());
        assert_eq!(check(Some(3), Some(GIB), 4 * GIB), Ok(()), "exactly 75%");
        assert!(check(Some(3), Some(GIB), 4 * GIB - 1).is_err());
        // The largest request (2^56 bytes) against the largest RAM: no overflow either way.
        assert_eq!(check(Some(DRIVE_COUNT_MAX), Some(DRIVE_SIZE_BYTES_MAX), u64::MAX), Ok(()));
        assert!(check(Some(DRIVE_COUNT_MAX), Some(DRIVE_SIZE_BYTES_MAX), 1 << 56).is_err());
        let message = check(Some(2), Some(8 * GIB), 10 * GIB).unwrap_err().to_string();
        for part in ["16GiB (2 x 8GiB)", "75% of the 10.0 GiB available", "--drive-size"] {
            assert!(message.contains(part), "{message:?} lacks {part:?}");
        }
        assert_eq!(DriveBackend::default(), DriveBackend::File);
        assert_eq!(DriveBackend::Memory.default_drive_size_bytes(), GIB);
        assert_eq!(DriveBackend::Memory.as_str(), "memory");
    }
}
