//! A node's configuration: where its data lives, its drives, and the addresses it serves.
//!
//! Drive geometry is chosen once, on the node's first start, and recorded in the metadata store;
//! on later starts the recorded geometry wins, and asking for a different one is an error
//! rather than a silent reformat.

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

pub const DRIVE_COUNT_MAX: u16 = 64;
pub const DRIVE_SIZE_BYTES_MIN: u64 = 64 << 20;
pub const DRIVE_SIZE_BYTES_MAX: u64 = 1 << 50;
/// Drive sizes are whole mebibytes, so every chunk size the engine may pick divides them evenly
/// enough and offsets stay aligned for O_DIRECT.
pub const DRIVE_SIZE_ALIGNMENT_BYTES: u64 = 1 << 20;
/// The directory under the data dir that holds the drive files.
pub const DRIVES_DIR_NAME: &str = "drives";

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
    pub nvme_listen: SocketAddr,
    pub api_listen: SocketAddr,
    /// Stop when the process receives SIGINT (Ctrl-C) or SIGTERM. The `ferrite up` binary sets
    /// this; tests that run nodes in-process leave it off.
    pub stop_on_signals: bool,
    /// Data-path threads serving NVMe/TCP; 0 means one per CPU.
    pub data_threads: usize,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            drive_count: None,
            drive_size_bytes: None,
            nvme_listen: DEFAULT_NVME_LISTEN,
            api_listen: DEFAULT_API_LISTEN,
            stop_on_signals: false,
            data_threads: 0,
        }
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
}

impl NodeConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
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
        assert_eq!(config.nvme_listen.to_string(), "127.0.0.1:4420");
        assert_eq!(config.drives_dir(), PathBuf::from("ferrite-data/drives"));
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
}
