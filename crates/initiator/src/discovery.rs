//! Discovery: connects to a target's discovery controller and reads the discovery log page
//! (log 70h), the list of subsystems and the addresses they are served at.

use std::time::Duration;

use nvmf::command::{log_page, Sqe};
use nvmf::structures::{DiscoveryLogEntry, DiscoveryLogHeader, DISCOVERY_LOG_RECORD_BYTES};
use types::{AlignedBuf, Nqn};

use crate::controller::{ConnectOptions, Controller, ADMIN_TRANSFER_BYTES};
use crate::error::InitiatorError;
use crate::host::HostIdentity;

/// One subsystem entry of the discovery log.
pub type DiscoveryEntry = DiscoveryLogEntry;

/// Most records read from one discovery log (1 MiB of entries).
pub const DISCOVERY_RECORDS_MAX: u64 = 1024;
/// Times the log is read again when its generation counter changed while it was read.
pub const DISCOVERY_ATTEMPTS_MAX: u32 = 5;
/// Pause before reading a log that changed again.
const DISCOVERY_RETRY_DELAY: Duration = Duration::from_millis(50);

const _: () = assert!(ADMIN_TRANSFER_BYTES % DISCOVERY_LOG_RECORD_BYTES == 0);

/// Reads the discovery log of the target at `address`, presenting `hostnqn` (with this process's
/// host identifier when it is the default host NQN, else an identifier of zeros).
pub async fn discover<A>(address: A, hostnqn: &Nqn) -> Result<Vec<DiscoveryEntry>, InitiatorError>
where
    A: tokio::net::ToSocketAddrs + std::fmt::Display,
{
    let default = crate::host::default_host();
    let host_id = if *hostnqn == default.nqn { default.host_id } else { [0; 16] };
    let options = ConnectOptions {
        host: Some(HostIdentity { nqn: hostnqn.clone(), host_id }),
        keep_alive_timeout: Duration::ZERO,
        ..ConnectOptions::default()
    };
    discover_with(address, options).await
}

/// [`discover`] with full connect options.
pub async fn discover_with<A>(
    address: A,
    options: ConnectOptions,
) -> Result<Vec<DiscoveryEntry>, InitiatorError>
where
    A: tokio::net::ToSocketAddrs + std::fmt::Display,
{
    let controller = Controller::connect_discovery(address, options).await?;
    let address = controller.address();
    for attempt in 1..=DISCOVERY_ATTEMPTS_MAX {
        let header = read_header(&controller).await?;
        if header.record_count > DISCOVERY_RECORDS_MAX {
            return Err(InitiatorError::Unsupported {
                address,
                problem: format!(
                    "the discovery log lists {} subsystems, more than the {DISCOVERY_RECORDS_MAX} this initiator reads",
                    header.record_count
                ),
            });
        }
        let record_count = header.record_count as usize;
        let mut entries = Vec::with_capacity(record_count);
        let total_bytes = record_count * DISCOVERY_LOG_RECORD_BYTES;
        let mut offset = 0;
        while offset < total_bytes {
            let length = (total_bytes - offset).min(ADMIN_TRANSFER_BYTES);
            let data =
                read_log(&controller, (DISCOVERY_LOG_RECORD_BYTES + offset) as u64, length).await?;
            entries.extend(
                data.chunks_exact(DISCOVERY_LOG_RECORD_BYTES).filter_map(DiscoveryLogEntry::decode),
            );
            offset += length;
        }
        let after = read_header(&controller).await?;
        if after.generation == header.generation {
            return Ok(entries);
        }
        tracing::debug!(%address, attempt, "discovery log changed while it was read; reading it again");
        tokio::time::sleep(DISCOVERY_RETRY_DELAY).await;
    }
    Err(InitiatorError::DiscoveryUnstable { address, attempts: DISCOVERY_ATTEMPTS_MAX })
}

async fn read_header(controller: &Controller) -> Result<DiscoveryLogHeader, InitiatorError> {
    let data = read_log(controller, 0, DISCOVERY_LOG_RECORD_BYTES).await?;
    DiscoveryLogHeader::decode(&data).ok_or_else(|| InitiatorError::Protocol {
        address: controller.address(),
        qid: 0,
        problem: "short discovery log header".to_owned(),
    })
}

/// `length` bytes of the discovery log from byte `offset`.
async fn read_log(
    controller: &Controller,
    offset: u64,
    length: usize,
) -> Result<AlignedBuf, InitiatorError> {
    let sqe = Sqe::get_log_page(0, 0, log_page::DISCOVERY, offset, length as u32);
    let mut buffer = AlignedBuf::new(length);
    buffer.set_len(length);
    let completion =
        controller.admin_command(sqe, Some(buffer), "Get Log Page (discovery)").await?;
    completion.buffer.ok_or_else(|| InitiatorError::Protocol {
        address: controller.address(),
        qid: 0,
        problem: "Get Log Page returned no data".to_owned(),
    })
}
