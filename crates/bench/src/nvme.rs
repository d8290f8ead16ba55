//! `ferrite bench` over NVMe/TCP: [`Connector`] and [`BlockQueue`] for the `initiator` crate's
//! controller and I/O queues.
//!
//! Hot path (`submit`, `next_completion`). A request's tag is the NVMe command identifier, its
//! buffer moves into the I/O queue and comes back with the completion, and requests longer than
//! the controller's MDTS are split inside the I/O queue; nothing is allocated or copied here.

use initiator::{ConnectOptions, Controller, InitiatorError, IoQueue, Nqn};

use crate::target::{BlockQueue, Connector, IoCompletion, IoKind, IoRequest, IoStatus};
use crate::url::NvmeTcpTarget;

/// Opens NVMe/TCP I/O queues to one subsystem. Each [`Connector::connect`] connects a new
/// controller (queue ids are not reused within one) and drops the previous one.
#[derive(Debug)]
pub struct NvmeConnector {
    /// `host:port`, resolved at each connect.
    address: String,
    subnqn: Nqn,
    options: ConnectOptions,
    controller: Option<Controller>,
}

/// A connector for a parsed `--target nvme+tcp://HOST:PORT/NQN`, with default options.
pub fn nvme_connector(target: &NvmeTcpTarget) -> NvmeConnector {
    NvmeConnector::new(target.address(), target.nqn.clone(), ConnectOptions::default())
}

impl NvmeConnector {
    /// A connector for `subnqn` at `address` (`host:port`, IPv6 hosts in brackets).
    pub fn new(address: String, subnqn: Nqn, options: ConnectOptions) -> NvmeConnector {
        NvmeConnector { address, subnqn, options, controller: None }
    }

    /// The controller of the last connect, while it lives.
    pub fn controller(&self) -> Option<&Controller> {
        self.controller.as_ref()
    }
}

impl Connector for NvmeConnector {
    type Queue = NvmeQueue;
    type Error = InitiatorError;

    async fn connect(
        &mut self,
        queue_count: u16,
        queue_depth: u16,
    ) -> Result<Vec<NvmeQueue>, InitiatorError> {
        self.controller = None;
        let options =
            ConnectOptions { io_queues_requested: queue_count.max(1), ..self.options.clone() };
        let controller = Controller::connect(self.address.as_str(), &self.subnqn, options).await?;
        let mut queues = Vec::with_capacity(usize::from(queue_count));
        for _ in 0..queue_count {
            queues.push(NvmeQueue::new(controller.open_io_queue(queue_depth).await?));
        }
        self.controller = Some(controller);
        Ok(queues)
    }
}

/// One NVMe/TCP I/O queue as a [`BlockQueue`].
#[derive(Debug)]
pub struct NvmeQueue {
    queue: IoQueue,
    /// log2 of the namespace's logical block size: byte offsets become LBAs by a shift.
    lba_shift: u32,
}

impl NvmeQueue {
    pub fn new(queue: IoQueue) -> NvmeQueue {
        let lba_size_bytes = queue.namespace().lba_size_bytes;
        assert!(lba_size_bytes.is_power_of_two(), "the initiator only accepts power-of-two blocks");
        NvmeQueue { queue, lba_shift: lba_size_bytes.trailing_zeros() }
    }

    pub fn io_queue(&self) -> &IoQueue {
        &self.queue
    }
}

impl BlockQueue for NvmeQueue {
    type Error = InitiatorError;

    fn size_bytes(&self) -> u64 {
        self.queue.size_bytes()
    }

    fn submit(&mut self, request: IoRequest) -> Result<(), InitiatorError> {
        let IoRequest { tag, kind, offset_bytes, buffer } = request;
        if offset_bytes & ((1 << self.lba_shift) - 1) != 0 {
            return Err(InitiatorError::InvalidRequest(format!(
                "offset {offset_bytes} is not a multiple of the namespace's {}-byte blocks",
                1u64 << self.lba_shift
            )));
        }
        let lba = offset_bytes >> self.lba_shift;
        match kind {
            IoKind::Read => self.queue.submit_read(tag, lba, buffer),
            IoKind::Write => self.queue.submit_write(tag, lba, buffer),
        }
    }

    async fn next_completion(&mut self) -> Result<IoCompletion, InitiatorError> {
        let completion = self.queue.next_completion().await?;
        let Some(buffer) = completion.buffer else {
            // Only reads and writes are submitted here, and both return their buffer.
            return Err(InitiatorError::InvalidRequest(format!(
                "completion of tag {} came back without its buffer",
                completion.tag
            )));
        };
        let status = if completion.status.is_success() {
            IoStatus::Success
        } else {
            IoStatus::Failed { status_code: completion.status.raw() }
        };
        Ok(IoCompletion { tag: completion.tag, buffer, status })
    }
}

#[cfg(test)]
mod tests {
    //! The bench engine over the initiator against `nvmf`'s target, served from RAM by the
    //! `initiator::testing::RamTarget` fixture.

    use std::time::Duration;

    use initiator::testing::{RamTarget, RamTargetOptions};

    use super::*;
    use crate::{run, BenchConfig, STANDARD_WORKLOADS};

    const BLOCK_BYTES: usize = 4096;
    const DISK_BLOCKS: u64 = 2048; // 8 MiB

    fn subsystem() -> Nqn {
        Nqn::new("nqn.2024-01.io.ferrite:vol:bench").unwrap()
    }

    /// Starts the target and returns it with its `host:port`; the target serves until dropped.
    async fn start_target() -> (RamTarget, String) {
        let target = RamTarget::start(RamTargetOptions {
            subnqn: subsystem(),
            size_blocks: DISK_BLOCKS,
            block_size_bytes: BLOCK_BYTES as u32,
            serial_number: "bench-test".into(),
            ..RamTargetOptions::default()
        })
        .await;
        let address = target.address().to_string();
        (target, address)
    }

    #[tokio::test]
    async fn five_workloads_verify_over_nvme_tcp() {
        let (_target, address) = start_target().await;
        let target: NvmeTcpTarget = match format!("nvme+tcp://{address}/{}", subsystem()).parse() {
            Ok(crate::TargetUrl::NvmeTcp(target)) => target,
            other => panic!("{other:?}"),
        };
        let mut connector = nvme_connector(&target);
        let config = BenchConfig {
            workloads: STANDARD_WORKLOADS.to_vec(),
            queue_count: 2,
            queue_depth: 8,
            ramp: Duration::ZERO,
            runtime: Duration::from_millis(200),
            region_size_bytes: None,
            fill: true,
            verify: true,
            seed: Some(7),
            progress: false,
        };
        let reports = tokio::time::timeout(Duration::from_secs(60), run(&config, &mut connector))
            .await
            .expect("the run finished")
            .unwrap();
        assert_eq!(reports.len(), 5);
        for report in &reports {
            assert!(report.ops() > 0, "{} did no I/O", report.workload);
            assert_eq!((report.errors, report.verify_mismatches), (0, 0), "{}", report.workload);
        }
        let controller = connector.controller().unwrap();
        assert_eq!(controller.namespace().unwrap().size_bytes(), DISK_BLOCKS * BLOCK_BYTES as u64);
    }

    #[tokio::test]
    async fn unknown_subsystem_fails_the_connect() {
        let (_target, address) = start_target().await;
        let unknown = Nqn::new("nqn.2024-01.io.ferrite:vol:missing").unwrap();
        let mut connector = NvmeConnector::new(address, unknown, ConnectOptions::default());
        let error = connector.connect(1, 4).await.unwrap_err();
        assert!(error.to_string().contains("Connect Invalid Parameters"), "{error}");
    }
}
