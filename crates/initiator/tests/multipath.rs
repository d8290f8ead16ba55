//! Multipath against `nvmf`'s target exposed on two listeners (two ports of one subsystem, as a
//! node with two listen addresses serves it): the initiator connects a controller on each path,
//! sends I/O down the optimized one, and fails over when the node makes that path inaccessible
//! (ANA) or when its connection breaks, as Linux's native multipath does.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use initiator::{ConnectOptions, MultipathNamespace, Nqn, PathState, Status};
use nvmf::target::{
    AnaState, Catalog, Listener, NamespaceInfo, Queue, StorageOperation, SubsystemInfo, Target,
    TargetConfig,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const BLOCK_BYTES: usize = 4096;
const DISK_BLOCKS: u64 = 1024;
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The server looks at its cut switch and keep-alive at least this often.
const SERVER_TICK: Duration = Duration::from_millis(50);
const NO_PORT: u16 = 0;

fn subsystem() -> Nqn {
    Nqn::new("nqn.2024-01.io.ferrite:vol:multipath").unwrap()
}

struct RamCatalog(NamespaceInfo);

impl Catalog for RamCatalog {
    fn subsystems(&self) -> Vec<SubsystemInfo> {
        vec![SubsystemInfo { nqn: subsystem() }]
    }
    fn namespace(&self, subnqn: &Nqn) -> Option<NamespaceInfo> {
        (*subnqn == subsystem()).then(|| self.0.clone())
    }
}

struct Shared {
    disk: Mutex<Vec<u8>>,
    /// Connections of this port drop at their next tick.
    cut_port: AtomicU16,
    /// Reads served, per port (index port_id - 1).
    reads: [AtomicU64; 2],
}

struct Server {
    target: Arc<Target>,
    addresses: Vec<String>,
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn start_server() -> Server {
    let listeners = [
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
    ];
    let local: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let config = TargetConfig {
        listeners: local
            .iter()
            .zip(1u16..)
            .map(|(address, port_id)| Listener {
                traddr: "127.0.0.1".into(),
                trsvcid: address.port().to_string(),
                port_id,
            })
            .collect(),
        ..TargetConfig::default()
    };
    let namespace = NamespaceInfo {
        volume: 1,
        size_blocks: Arc::new(AtomicU64::new(DISK_BLOCKS)),
        block_size_bytes: BLOCK_BYTES as u32,
        nguid: [4; 16],
        uuid: [5; 16],
        eui64: [6; 8],
        serial_number: "multipath".into(),
    };
    let target = Arc::new(Target::new(config, Arc::new(RamCatalog(namespace))));
    let shared = Arc::new(Shared {
        disk: Mutex::new(vec![0; DISK_BLOCKS as usize * BLOCK_BYTES]),
        cut_port: AtomicU16::new(NO_PORT),
        reads: [AtomicU64::new(0), AtomicU64::new(0)],
    });
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (listener, port_id) in listeners.into_iter().zip(1u16..) {
        let target = Arc::clone(&target);
        let shared = Arc::clone(&shared);
        tasks.push(tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else { return };
                let now_ms = started.elapsed().as_millis() as u64;
                let queue =
                    Queue::new_on_port(Arc::clone(&target), peer.to_string(), port_id, now_ms);
                tokio::spawn(serve(queue, port_id, stream, Arc::clone(&shared), started));
            }
        }));
    }
    let addresses = local.iter().map(SocketAddr::to_string).collect();
    Server { target, addresses, shared, tasks }
}

/// One connection's driver: bytes in, storage on the RAM disk, bytes out.
async fn serve(
    mut queue: Queue,
    port_id: u16,
    mut stream: TcpStream,
    shared: Arc<Shared>,
    started: Instant,
) {
    stream.set_nodelay(true).unwrap();
    let now_ms = || started.elapsed().as_millis() as u64;
    let mut buffer = vec![0u8; Queue::pdu_size_max() + 64 * 1024];
    let mut filled = 0;
    loop {
        if shared.cut_port.load(Ordering::SeqCst) == port_id {
            return;
        }
        while let Some(request) = queue.next_request() {
            let buf = execute(&shared, port_id, request.operation);
            queue.complete(request.id, Ok(()), buf);
        }
        let length = queue.output().len();
        if length > 0 {
            if stream.write_all(queue.output()).await.is_err() {
                return;
            }
            queue.consume_output(length);
        }
        if queue.wants_close() || queue.keep_alive_expired(now_ms()) {
            return;
        }
        let read = match tokio::time::timeout(SERVER_TICK, stream.read(&mut buffer[filled..])).await
        {
            Err(_) => {
                queue.poll(now_ms());
                continue;
            }
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(read)) => read,
        };
        filled += read;
        match queue.receive(&buffer[..filled], now_ms()) {
            Ok(consumed) => {
                buffer.copy_within(consumed..filled, 0);
                filled -= consumed;
            }
            Err(_) => {
                let _ = stream.write_all(queue.output()).await;
                return;
            }
        }
    }
}

fn execute(
    shared: &Shared,
    port_id: u16,
    operation: StorageOperation,
) -> Option<types::AlignedBuf> {
    let mut disk = shared.disk.lock().unwrap();
    let range = |lba: u64, blocks: u32| {
        lba as usize * BLOCK_BYTES..(lba as usize + blocks as usize) * BLOCK_BYTES
    };
    match operation {
        StorageOperation::Read { lba, blocks, mut buf } => {
            shared.reads[usize::from(port_id) - 1].fetch_add(1, Ordering::SeqCst);
            let bytes = range(lba, blocks);
            let length = bytes.len();
            buf[..length].copy_from_slice(&disk[bytes]);
            Some(buf)
        }
        StorageOperation::Write { lba, blocks, buf } => {
            let bytes = range(lba, blocks);
            let length = bytes.len();
            disk[bytes].copy_from_slice(&buf[..length]);
            Some(buf)
        }
        StorageOperation::Flush | StorageOperation::WriteZeroes { .. } => None,
        StorageOperation::Deallocate { ranges } => Some(ranges.into_buf()),
    }
}

fn reads(server: &Server) -> [u64; 2] {
    [0, 1].map(|index| server.shared.reads[index].load(Ordering::SeqCst))
}

async fn with_timeout<F: std::future::Future>(future: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, future).await.expect("the test hung")
}

#[tokio::test]
async fn fails_over_on_ana_change_and_on_a_broken_path() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        let mut device =
            MultipathNamespace::connect(&server.addresses, &nqn, ConnectOptions::default(), 8)
                .await
                .unwrap();
        let paths = device.paths();
        assert_eq!(paths.len(), 2);
        assert!(paths.iter().all(|path| path.state == PathState::Optimized));
        assert_ne!(paths[0].cntlid, paths[1].cntlid, "one controller per path");
        assert_eq!(device.current_path(), Some(0), "the first optimized path");

        let data: Vec<u8> = (0..2 * BLOCK_BYTES).map(|i| (i % 253) as u8).collect();
        device.write(10, &data).await.unwrap();
        assert_eq!(&device.read(10, data.len()).await.unwrap()[..], &data[..]);
        assert_eq!(reads(&server), [1, 0]);

        // The node makes port 1 inaccessible: the next read gets ANA Inaccessible there, the
        // host rereads the ANA logs and the read succeeds on port 2.
        server.target.set_ana_state(&nqn, 1, AnaState::Inaccessible);
        assert_eq!(&device.read(10, data.len()).await.unwrap()[..], &data[..]);
        assert_eq!(reads(&server), [1, 1]);
        assert_eq!(device.current_path(), Some(1));
        assert_eq!(device.paths()[0].state, PathState::Inaccessible);

        // Port 1 optimized again, port 2 non-optimized: a refresh moves I/O back.
        server.target.set_ana_state(&nqn, 1, AnaState::Optimized);
        server.target.set_ana_state(&nqn, 2, AnaState::NonOptimized);
        device.refresh().await.unwrap();
        assert_eq!(device.current_path(), Some(0));
        assert_eq!(device.paths()[1].state, PathState::NonOptimized);
        device.read(10, BLOCK_BYTES).await.unwrap();
        assert_eq!(reads(&server), [2, 1]);

        // Port 1's connections break: the read fails over to the non-optimized path.
        server.shared.cut_port.store(1, Ordering::SeqCst);
        tokio::time::sleep(3 * SERVER_TICK).await;
        assert_eq!(&device.read(10, data.len()).await.unwrap()[..], &data[..]);
        assert_eq!(device.current_path(), Some(1));
        assert_eq!(device.paths()[0].state, PathState::Down);

        // Port 1 comes back: a refresh reconnects it and prefers it again.
        server.shared.cut_port.store(NO_PORT, Ordering::SeqCst);
        device.refresh().await.unwrap();
        assert_eq!(device.current_path(), Some(0));
        assert_eq!(device.paths()[0].state, PathState::Optimized);

        // A command error that is not about the path is returned, not retried elsewhere.
        let error = device.read(DISK_BLOCKS, BLOCK_BYTES).await.unwrap_err();
        assert!(error.status().is_some_and(|status| status.same_code(Status::LBA_OUT_OF_RANGE)));
        assert_eq!(device.current_path(), Some(0));
    })
    .await;
}

#[tokio::test]
async fn every_path_inaccessible_is_an_error_after_bounded_retries() {
    with_timeout(async {
        let server = start_server().await;
        let nqn = subsystem();
        let mut device =
            MultipathNamespace::connect(&server.addresses, &nqn, ConnectOptions::default(), 4)
                .await
                .unwrap();
        server.target.set_ana_state(&nqn, 1, AnaState::Inaccessible);
        server.target.set_ana_state(&nqn, 2, AnaState::PersistentLoss);
        let error = device.read(0, BLOCK_BYTES).await.unwrap_err();
        assert!(error.status().is_some_and(|status| status.is_path_error()), "{error}");
        assert_eq!(device.current_path(), None);
        // A path that connects but cannot be reached for I/O is not chosen; one that cannot
        // connect at all makes connect fail only when it is the only one.
        let lone = MultipathNamespace::connect(
            &["127.0.0.1:1".to_owned()],
            &nqn,
            ConnectOptions { connect_timeout: Duration::from_millis(500), ..Default::default() },
            4,
        )
        .await;
        assert!(lone.is_err());
    })
    .await;
}
