//! The REST API end to end, in process: a real node on 127.0.0.1:0 with a real metadata store,
//! driven through the real `api::Client`, with a test data plane in place of the NVMe/TCP one.

use api::{AccessMode, Client, ClientError, CreateVolume, ErrorCode};
use meta::{Chunk, HostAccess, VolumeRecord};
use node::metrics::Registry;
use node::{
    Capacity, DataPathBuilder, DataPathContext, DataPlane, DataPlaneError, DriveSet, Node,
    NodeConfig, NodeError,
};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const MIB: u64 = 1 << 20;
/// The fixture's chunk: 1 MiB, so sizes map to chunk counts directly.
const CHUNK_SIZE_BYTES: u64 = MIB;

/// What a test can see and steer of its fixture data path.
#[derive(Default)]
struct Probe {
    formats: AtomicUsize,
    started_with: Mutex<Vec<String>>,
    fail_reservations: AtomicBool,
    shut_down: AtomicBool,
    metrics: Mutex<Option<Arc<Registry>>>,
    /// Every `set_host_access`: the volume and its new access.
    host_access: Mutex<Vec<(String, HostAccess)>>,
    /// The volumes the data path started with, as their records.
    started_records: Mutex<Vec<VolumeRecord>>,
}

/// Test fixture: a data path that allocates 1 MiB chunks from a set, serves nothing, and
/// reports what happens to it through a [`Probe`].
struct FixturePath {
    probe: Arc<Probe>,
    nvme_addr: SocketAddr,
}

struct FixturePlane {
    probe: Arc<Probe>,
    chunk_count: u32,
    free: Mutex<BTreeSet<u32>>,
    nvme_addr: SocketAddr,
}

impl DataPathBuilder for FixturePath {
    fn format_drives(&mut self, drives: &DriveSet) -> Result<(), DataPlaneError> {
        assert!(!drives.dir.exists(), "the fixture creates no drive files");
        self.probe.formats.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn start(
        self: Box<Self>,
        context: DataPathContext,
    ) -> Result<Arc<dyn DataPlane>, DataPlaneError> {
        let chunk_count =
            (u64::from(context.drives.count) * context.drives.size_bytes / CHUNK_SIZE_BYTES) as u32;
        let mut free: BTreeSet<u32> = (0..chunk_count).collect();
        for volume in &context.volumes {
            for (_, index) in &volume.chunks {
                assert!(free.remove(index), "chunk {index} is held by two volumes");
            }
        }
        *self.probe.started_with.lock().unwrap() =
            context.volumes.iter().map(|volume| volume.name.to_string()).collect();
        *self.probe.started_records.lock().unwrap() = context.volumes.clone();
        *self.probe.metrics.lock().unwrap() = Some(context.metrics);
        Ok(Arc::new(FixturePlane {
            probe: self.probe,
            chunk_count,
            free: Mutex::new(free),
            nvme_addr: self.nvme_addr,
        }))
    }
}

impl FixturePlane {
    fn take(&self, size_bytes: u64) -> Result<Vec<Chunk>, DataPlaneError> {
        if self.probe.fail_reservations.load(Ordering::Relaxed) {
            return Err(DataPlaneError::failed("injected drive failure"));
        }
        let mut free = self.free.lock().unwrap();
        let needed = size_bytes.div_ceil(CHUNK_SIZE_BYTES) as usize;
        if needed > free.len() {
            return Err(DataPlaneError::NoSpace {
                requested_bytes: size_bytes,
                free_bytes: free.len() as u64 * CHUNK_SIZE_BYTES,
            });
        }
        let taken: Vec<u32> = free.iter().copied().take(needed).collect();
        for index in &taken {
            free.remove(index);
        }
        Ok(taken.into_iter().map(|index| (0, index)).collect())
    }
}

impl DataPlane for FixturePlane {
    fn reserve_create(&self, _id: u64, size_bytes: u64) -> Result<Vec<Chunk>, DataPlaneError> {
        self.take(size_bytes)
    }

    fn reserve_grow(
        &self,
        volume: &VolumeRecord,
        size_bytes: u64,
    ) -> Result<Vec<Chunk>, DataPlaneError> {
        let mut chunks = volume.chunks.clone();
        chunks.extend(self.take(size_bytes - volume.size_bytes)?);
        Ok(chunks)
    }

    fn cancel(&self, _proposed: &VolumeRecord) {
        panic!("no metadata write fails in these tests");
    }

    fn publish(&self, _volume: &VolumeRecord) {}

    fn remove(&self, volume: &VolumeRecord) {
        self.free.lock().unwrap().extend(volume.chunks.iter().map(|(_, index)| *index));
    }

    fn set_host_access(&self, volume: &VolumeRecord) {
        self.probe
            .host_access
            .lock()
            .unwrap()
            .push((volume.name.to_string(), volume.host_access.clone()));
    }

    fn capacity(&self) -> Capacity {
        Capacity {
            total_bytes: u64::from(self.chunk_count) * CHUNK_SIZE_BYTES,
            free_bytes: self.free.lock().unwrap().len() as u64 * CHUNK_SIZE_BYTES,
            chunk_size_bytes: CHUNK_SIZE_BYTES,
            ..Capacity::default()
        }
    }

    fn nvme_addr(&self) -> Option<SocketAddr> {
        Some(self.nvme_addr)
    }

    fn shutdown(&self) {
        self.probe.shut_down.store(true, Ordering::Relaxed);
    }
}

/// A config for a node in `dir` on free ports, with one 64 MiB drive (64 fixture chunks).
fn config(dir: &Path) -> NodeConfig {
    NodeConfig {
        data_dir: dir.join("data"),
        drive_count: Some(1),
        drive_size_bytes: Some(64 * MIB),
        drives: Vec::new(),
        lay_out_drives: false,
        nvme_listen: vec!["127.0.0.1:0".parse().unwrap()],
        nbd_listen: None,
        api_listen: "127.0.0.1:0".parse().unwrap(),
        stop_on_signals: false,
        data_threads: 1,
        poll_us: 0,
        read_defrag: None,
        scrub_mb_per_s: 0,
        erasure_coding: None,
        rebuild_mb_per_s: 0,
        cluster: None,
    }
}

fn start(dir: &Path, probe: &Arc<Probe>) -> Node {
    let fixture =
        FixturePath { probe: Arc::clone(probe), nvme_addr: "127.0.0.1:4420".parse().unwrap() };
    Node::start_with(config(dir), Box::new(fixture)).unwrap()
}

fn create(client: &Client, name: &str, size_bytes: u64) -> Result<api::VolumeInfo, ClientError> {
    client.create_volume(&CreateVolume::empty(name, size_bytes))
}

#[track_caller]
fn assert_api_error<T: std::fmt::Debug>(
    result: Result<T, ClientError>,
    code: ErrorCode,
    message: &str,
) {
    match result {
        Err(ClientError::Api { status, code: got, message: text }) => {
            assert_eq!(got, code.as_str(), "{text}");
            assert_eq!(status, code.http_status(), "{text}");
            assert!(text.contains(message), "{text:?} does not contain {message:?}");
        }
        other => panic!("expected API error {code:?}, got {other:?}"),
    }
}

#[test]
fn volume_lifecycle_through_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Arc::new(Probe::default());
    let node = start(dir.path(), &probe);
    let client = Client::new(&node.api_url()).unwrap();
    client.health().unwrap();
    assert!(client.list_volumes().unwrap().is_empty());

    let created = create(&client, "db-1", 8 * MIB).unwrap();
    assert_eq!(created.name, "db-1");
    assert_eq!(created.size_bytes, 8 * MIB);
    assert_eq!(created.nqn, "nqn.2024-01.io.ferrite:vol:db-1");
    assert_eq!(
        created.nvme_connect_command(),
        "nvme connect -t tcp -a 127.0.0.1 -s 4420 -n nqn.2024-01.io.ferrite:vol:db-1"
    );
    assert_eq!(created.uuid.len(), 36);
    let other = create(&client, "a-first", MIB).unwrap();
    assert!(other.id > created.id);

    assert_eq!(client.volume("db-1").unwrap(), created);
    let names: Vec<String> = client.list_volumes().unwrap().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["a-first", "db-1"]);

    let grown = client.resize_volume("db-1", 16 * MIB).unwrap();
    assert_eq!(grown.size_bytes, 16 * MIB);
    assert_eq!(grown.id, created.id);
    assert_eq!(client.volume("db-1").unwrap().size_bytes, 16 * MIB);

    let info = client.node().unwrap();
    assert_eq!(info.volume_count, 2);
    assert!(info.nvme_serving);
    assert_eq!(info.drive_count, 1);
    assert_eq!(info.capacity.total_bytes, 64 * MIB);
    assert_eq!(info.capacity.free_bytes, (64 - 17) * MIB);
    assert_eq!(info.capacity.chunk_size_bytes, CHUNK_SIZE_BYTES);

    // The data path records into the registry it was given; the scrape shows it.
    let registry = probe.metrics.lock().unwrap().clone().unwrap();
    registry.volume(created.id).record_read(4096, 120);
    let metrics = client.metrics().unwrap();
    assert!(metrics.contains("ferrite_volumes 2\n"), "{metrics}");
    assert!(metrics.contains(&format!("ferrite_capacity_free_bytes {}\n", 47 * MIB)), "{metrics}");
    let read_count = format!(
        "ferrite_volume_operations_total{{volume=\"db-1\",volume_id=\"{}\",op=\"read\"}} 1\n",
        created.id
    );
    assert!(metrics.contains(&read_count), "{metrics}");

    let deleted = client.delete_volume("db-1").unwrap();
    assert_eq!(deleted.size_bytes, 16 * MIB);
    assert_api_error(
        client.volume("db-1"),
        ErrorCode::VolumeNotFound,
        "volume db-1 does not exist",
    );
    assert_eq!(client.node().unwrap().capacity.free_bytes, 63 * MIB);
    assert!(!client.metrics().unwrap().contains("volume=\"db-1\""));

    node.stop().unwrap();
    assert!(probe.shut_down.load(Ordering::Relaxed));
}

#[test]
fn every_error_code() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Arc::new(Probe::default());
    let node = start(dir.path(), &probe);
    let client = Client::new(&node.api_url()).unwrap();
    create(&client, "db", 4 * MIB).unwrap();

    assert_api_error(
        create(&client, "db", MIB),
        ErrorCode::VolumeExists,
        "volume db already exists",
    );
    assert_api_error(
        client.volume("nope"),
        ErrorCode::VolumeNotFound,
        "volume nope does not exist",
    );
    assert_api_error(client.delete_volume("nope"), ErrorCode::VolumeNotFound, "does not exist");
    assert_api_error(client.resize_volume("nope", 8 * MIB), ErrorCode::VolumeNotFound, "nope");
    assert_api_error(
        create(&client, "x", 4097),
        ErrorCode::InvalidSize,
        "invalid volume size 4097",
    );
    assert_api_error(create(&client, "x", 0), ErrorCode::InvalidSize, "invalid volume size 0");
    assert_api_error(client.resize_volume("db", 1 << 60), ErrorCode::InvalidSize, "1 PiB");
    assert_api_error(create(&client, "Bad", MIB), ErrorCode::InvalidName, "invalid volume name");
    assert_api_error(client.volume("a/../db"), ErrorCode::InvalidName, "invalid volume name");
    assert_api_error(client.volume("db%"), ErrorCode::InvalidName, "invalid volume name");
    assert_api_error(
        create(&client, "big", 61 * MIB),
        ErrorCode::NoSpace,
        "needs 61MiB more and 60MiB is free",
    );
    assert_api_error(client.resize_volume("db", 65 * MIB), ErrorCode::NoSpace, "needs 61MiB more");
    assert_api_error(
        client.resize_volume("db", 2 * MIB),
        ErrorCode::ShrinkRefused,
        "volume db is 4MiB and cannot shrink to 2MiB: volumes only grow",
    );
    probe.fail_reservations.store(true, Ordering::Relaxed);
    assert_api_error(create(&client, "new", MIB), ErrorCode::Internal, "injected drive failure");
    probe.fail_reservations.store(false, Ordering::Relaxed);
    assert_eq!(client.list_volumes().unwrap().len(), 1, "no refusal created anything");

    // Requests the typed client cannot make.
    let raw = |method: &str, path: &str, body: &[u8]| -> (u16, api::ErrorBody) {
        let url = format!("{}{path}", node.api_url());
        let response = match ureq::request(method, &url).send_bytes(body) {
            Ok(response) => panic!("{method} {path} succeeded: {}", response.status()),
            Err(ureq::Error::Status(status, response)) => (status, response),
            Err(error) => panic!("{method} {path}: {error}"),
        };
        (response.0, response.1.into_json().unwrap())
    };
    let check = |method: &str, path: &str, body: &[u8], code: ErrorCode| {
        let (status, error) = raw(method, path, body);
        assert_eq!(error.code, code.as_str(), "{method} {path}: {}", error.error);
        assert_eq!(status, code.http_status(), "{method} {path}");
        assert!(!error.error.is_empty());
    };
    check("POST", "/v1/volumes", b"{not json", ErrorCode::InvalidRequest);
    check("POST", "/v1/volumes", br#"{"name":"x"}"#, ErrorCode::InvalidRequest);
    check("POST", "/v1/volumes", br#"{"name":"x","size_bytes":-1}"#, ErrorCode::InvalidRequest);
    check("POST", "/v1/volumes/db/resize", b"", ErrorCode::InvalidRequest);
    let huge = vec![b' '; node::http::REQUEST_BODY_SIZE_BYTES_MAX + 1];
    check("POST", "/v1/volumes", &huge, ErrorCode::RequestTooLarge);
    check("GET", "/v2/volumes", b"", ErrorCode::NotFound);
    check("PUT", "/v1/volumes/db", b"", ErrorCode::MethodNotAllowed);
    check("DELETE", "/v1/volumes", b"", ErrorCode::MethodNotAllowed);

    node.stop().unwrap();
}

#[test]
fn restart_keeps_volumes_and_drives() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Arc::new(Probe::default());
    let node = start(dir.path(), &probe);
    assert!(node.first_start());
    let uuid = node.record().uuid;
    let client = Client::new(&node.api_url()).unwrap();
    let kept = create(&client, "kept", 2 * MIB).unwrap();
    create(&client, "gone", MIB).unwrap();
    client.resize_volume("kept", 3 * MIB).unwrap();
    client.delete_volume("gone").unwrap();

    // A second node on the same data dir is refused while the first runs.
    let fixture = FixturePath { probe: Arc::default(), nvme_addr: "127.0.0.1:1".parse().unwrap() };
    let error = Node::start_with(config(dir.path()), Box::new(fixture)).err().unwrap();
    assert!(error.to_string().contains("is another `ferrite up` running"), "{error}");
    node.stop().unwrap();

    let probe_again = Arc::new(Probe::default());
    let node = start(dir.path(), &probe_again);
    assert!(!node.first_start());
    assert_eq!(node.record().uuid, uuid);
    assert_eq!(probe.formats.load(Ordering::Relaxed), 1);
    assert_eq!(probe_again.formats.load(Ordering::Relaxed), 0, "drives are formatted once");
    assert_eq!(*probe_again.started_with.lock().unwrap(), ["kept"]);
    let client = Client::new(&node.api_url()).unwrap();
    let volumes = client.list_volumes().unwrap();
    assert_eq!(volumes.len(), 1);
    assert_eq!(volumes[0].size_bytes, 3 * MIB);
    assert_eq!(volumes[0].uuid, kept.uuid);
    let next = create(&client, "next", MIB).unwrap();
    assert!(next.id > kept.id + 1, "ids are not reused across restarts");
    node.stop().unwrap();

    // Drive geometry is fixed at the first start.
    let mut changed = config(dir.path());
    changed.drive_count = Some(2);
    let fixture = FixturePath { probe: Arc::default(), nvme_addr: "127.0.0.1:1".parse().unwrap() };
    let error = Node::start_with(changed, Box::new(fixture)).err().unwrap();
    assert!(matches!(error, NodeError::DrivesChanged { .. }), "{error}");
    assert!(error.to_string().contains("1 drives of 64MiB"), "{error}");
    let mut unspecified = config(dir.path());
    unspecified.drive_count = None;
    unspecified.drive_size_bytes = None;
    let fixture = FixturePath { probe: Arc::default(), nvme_addr: "127.0.0.1:1".parse().unwrap() };
    Node::start_with(unspecified, Box::new(fixture)).unwrap().stop().unwrap();
}

#[test]
fn the_real_data_path_is_thin() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(config(dir.path())).unwrap();
    assert!(node.nvme_serving());
    assert!(node.data_dir().join("drives").join("drive-000.img").exists());
    let client = Client::new(&node.api_url()).unwrap();
    let info = client.node().unwrap();
    assert!(info.nvme_serving);
    let capacity = info.capacity;
    assert!(capacity.total_bytes > 32 * MIB && capacity.total_bytes < 64 * MIB, "{capacity:?}");
    assert_eq!(capacity.free_bytes, capacity.total_bytes);
    assert_eq!((capacity.chunk_size_bytes, capacity.mapped_bytes), (0, 0));
    // Thin: volumes larger than the node are created, and take no space until written.
    let volume = create(&client, "a", 1 << 30).unwrap();
    assert_eq!(volume.mapped_bytes, None, "create reports the record only");
    let info = client.node().unwrap();
    assert_eq!(info.capacity.free_bytes, capacity.total_bytes);
    assert_eq!(info.capacity.provisioned_bytes, 1 << 30);
    client.resize_volume("a", 2 << 30).unwrap();
    let shown = client.volume("a").unwrap();
    assert_eq!((shown.size_bytes, shown.mapped_bytes), (2 << 30, Some(0)));
    assert_eq!(shown.physical_used_bytes, Some(0));
    assert_eq!(client.node().unwrap().capacity.provisioned_bytes, 2 << 30);
    client.delete_volume("a").unwrap();
    assert_eq!(client.node().unwrap().capacity.provisioned_bytes, 0);
    let metrics = client.metrics().unwrap();
    assert!(metrics.contains("ferrite_mapped_bytes 0\n"), "{metrics}");
    assert!(metrics.contains("ferrite_checksum_errors_total 0\n"), "{metrics}");

    let stop = node.stop_handle();
    let waiter = std::thread::spawn(move || {
        node.wait_for_stop();
        node.stop()
    });
    stop.stop();
    waiter.join().unwrap().unwrap();
    assert!(matches!(client.health(), Err(ClientError::Unreachable { .. })));
}

/// `--lay-out-drives`: the first start writes zeros over every drive file, so none is sparse;
/// the node then serves as usual, and a restart lays out nothing again. With external drives
/// or memory drives it is refused with the reason.
#[test]
fn drive_files_laid_out_on_the_first_start_are_not_sparse() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let config = NodeConfig { drive_count: Some(2), lay_out_drives: true, ..config(dir.path()) };
    let allocated = |index: usize| {
        let path = dir.path().join("data").join("drives").join(format!("drive-00{index}.img"));
        std::fs::metadata(path).unwrap().blocks() * 512
    };
    let node = Node::start(config.clone()).unwrap();
    assert!(node.nvme_serving());
    for index in 0..2 {
        assert!(
            // All but the header region's unwritten blocks (its first 1 MiB).
            allocated(index) >= 63 * MIB,
            "drive {index}: {} bytes allocated",
            allocated(index)
        );
    }
    let client = Client::new(&node.api_url()).unwrap();
    create(&client, "a", 1 << 30).unwrap();
    assert_eq!(client.node().unwrap().capacity.mapped_bytes, 0);
    node.stop().unwrap();
    let node = Node::start(config.clone()).unwrap();
    let client = Client::new(&node.api_url()).unwrap();
    assert_eq!(client.volume("a").unwrap().size_bytes, 1 << 30);
    node.stop().unwrap();

    let external = NodeConfig {
        drive_count: None,
        drive_size_bytes: None,
        drives: vec![dir.path().join("some-drive")],
        ..config.clone()
    };
    let error = Node::start(external).err().expect("refused").to_string();
    assert!(error.contains("--lay-out-drives applies to the drive files"), "{error}");
    let memory_dir = tempfile::tempdir().unwrap();
    let memory = NodeConfig { data_dir: memory_dir.path().join("data"), ..config };
    let error = Node::start_on(memory, node::DriveBackend::Memory).err().expect("refused");
    assert!(error.to_string().contains("--lay-out-drives cannot be used with"), "{error}");
}

const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000000a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000000b";

fn restricted(hosts: &[&str]) -> HostAccess {
    HostAccess::Restricted(hosts.iter().map(|host| types::Nqn::new(host).unwrap()).collect())
}

#[test]
fn host_access_through_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Arc::new(Probe::default());
    let node = start(dir.path(), &probe);
    let client = Client::new(&node.api_url()).unwrap();
    create(&client, "db", MIB).unwrap();
    assert_eq!(client.volume("db").unwrap().access, AccessMode::Open);

    let access = client.host_access("db").unwrap();
    assert_eq!(access.volume, "db");
    assert_eq!(access.nqn, "nqn.2024-01.io.ferrite:vol:db");
    assert_eq!(access.access, AccessMode::Open);
    assert!(access.hosts.is_empty());

    let access = client.allow_host("db", HOST_B).unwrap();
    assert_eq!(access.access, AccessMode::Restricted);
    assert_eq!(access.hosts, [HOST_B]);
    let access = client.allow_host("db", HOST_A).unwrap();
    assert_eq!(access.hosts, [HOST_A, HOST_B], "hosts are listed sorted");
    assert_eq!(client.allow_host("db", HOST_A).unwrap(), access, "allowing twice is a no-op");
    assert_eq!(client.host_access("db").unwrap(), access);
    assert_eq!(client.volume("db").unwrap().access, AccessMode::Restricted);

    let access = client.deny_host("db", HOST_A).unwrap();
    assert_eq!(access.hosts, [HOST_B]);
    assert_eq!(client.deny_host("db", HOST_A).unwrap(), access, "denying twice is a no-op");
    let access = client.deny_host("db", HOST_B).unwrap();
    assert_eq!(access.access, AccessMode::Restricted, "denying the last host keeps it closed");
    assert!(access.hosts.is_empty());

    let access = client.allow_host("db", api::ANY_HOST).unwrap();
    assert_eq!(access.access, AccessMode::Open);
    let access = client.deny_host("db", api::ANY_HOST).unwrap();
    assert_eq!((access.access, access.hosts.len()), (AccessMode::Restricted, 0));
    client.allow_host("db", HOST_A).unwrap();

    assert_eq!(
        *probe.host_access.lock().unwrap(),
        [
            ("db".to_owned(), restricted(&[HOST_B])),
            ("db".to_owned(), restricted(&[HOST_A, HOST_B])),
            ("db".to_owned(), restricted(&[HOST_B])),
            ("db".to_owned(), restricted(&[])),
            ("db".to_owned(), HostAccess::Open),
            ("db".to_owned(), restricted(&[])),
            ("db".to_owned(), restricted(&[HOST_A])),
        ],
        "the data path hears of each change"
    );

    // The list is kept across a restart, and the data path starts with it.
    client.resize_volume("db", 2 * MIB).unwrap();
    node.stop().unwrap();
    let probe = Arc::new(Probe::default());
    let node = start(dir.path(), &probe);
    let client = Client::new(&node.api_url()).unwrap();
    let access = client.host_access("db").unwrap();
    assert_eq!((access.access, access.hosts), (AccessMode::Restricted, vec![HOST_A.to_owned()]));
    let started = probe.started_records.lock().unwrap().clone();
    assert_eq!(started.len(), 1);
    assert_eq!(started[0].host_access, restricted(&[HOST_A]));
    assert_eq!(started[0].size_bytes, 2 * MIB);
    node.stop().unwrap();
}

#[test]
fn host_access_errors() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Arc::new(Probe::default());
    let node = start(dir.path(), &probe);
    let client = Client::new(&node.api_url()).unwrap();
    create(&client, "db", MIB).unwrap();

    assert_api_error(
        client.deny_host("db", HOST_A),
        ErrorCode::HostAccessOpen,
        "volume db is open to any host, so one host cannot be denied",
    );
    assert_api_error(
        client.allow_host("db", "host-a"),
        ErrorCode::InvalidNqn,
        "invalid NQN \"host-a\"",
    );
    assert_api_error(client.deny_host("db", "nqn.a b"), ErrorCode::InvalidNqn, "invalid NQN");
    assert_api_error(client.allow_host("db", "ANY"), ErrorCode::InvalidNqn, "or `any`");
    let long = format!("nqn.{}", "a".repeat(220));
    assert_api_error(client.allow_host("db", &long), ErrorCode::InvalidNqn, "223 bytes");
    assert_api_error(
        client.host_access("nope"),
        ErrorCode::VolumeNotFound,
        "volume nope does not exist",
    );
    assert_api_error(client.allow_host("nope", HOST_A), ErrorCode::VolumeNotFound, "nope");
    assert_api_error(client.deny_host("nope", "any"), ErrorCode::VolumeNotFound, "nope");
    assert_api_error(client.host_access("Bad"), ErrorCode::InvalidName, "invalid volume name");
    assert_api_error(client.allow_host("a/b", HOST_A), ErrorCode::InvalidName, "invalid volume");
    assert!(probe.host_access.lock().unwrap().is_empty(), "no refusal changed anything");
    assert_eq!(client.host_access("db").unwrap().access, AccessMode::Open);

    // Requests the typed client cannot make.
    let status = |method: &str, path: &str| -> (u16, String) {
        let url = format!("{}{path}", node.api_url());
        match ureq::request(method, &url).call() {
            Ok(response) => (response.status(), String::new()),
            Err(ureq::Error::Status(status, response)) => {
                (status, response.into_json::<api::ErrorBody>().unwrap().code)
            }
            Err(error) => panic!("{method} {path}: {error}"),
        }
    };
    assert_eq!(status("POST", "/v1/volumes/db/hosts"), (405, "method_not_allowed".to_owned()));
    assert_eq!(status("GET", "/v1/volumes/db/hosts/any"), (405, "method_not_allowed".to_owned()));
    assert_eq!(status("PUT", "/v1/volumes/db/hosts/"), (404, "not_found".to_owned()));
    // An NQN's ':' may also come unencoded; it is legal in a path segment.
    assert_eq!(status("PUT", "/v1/volumes/db/hosts/nqn.x:y").0, 200);
    assert_eq!(client.host_access("db").unwrap().hosts, ["nqn.x:y"]);
    node.stop().unwrap();
}

/// Compression through the API: lz4 unless told otherwise, validated, changeable, kept in the
/// record across restarts, and handed to the data path at start.
#[test]
fn compression_through_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Arc::new(Probe::default());
    let node = start(dir.path(), &probe);
    let client = Client::new(&node.api_url()).unwrap();
    let plain = create(&client, "plain", MIB).unwrap();
    assert_eq!((plain.compression.as_str(), plain.data_reduction), ("lz4", 1.0));
    let zstd = CreateVolume::empty("small", MIB).with_compression("zstd");
    assert_eq!(client.create_volume(&zstd).unwrap().compression, "zstd");
    let raw = CreateVolume::empty("raw", MIB).with_compression("off");
    assert_eq!(client.create_volume(&raw).unwrap().compression, "off");
    assert_api_error(
        client.create_volume(&CreateVolume::empty("bad", MIB).with_compression("gzip")),
        ErrorCode::InvalidRequest,
        "unknown compression \"gzip\": give lz4 (the default: fast), zstd (smaller, more CPU) or off",
    );
    assert_api_error(client.volume("bad"), ErrorCode::VolumeNotFound, "bad");
    let listed: Vec<(String, String)> =
        client.list_volumes().unwrap().into_iter().map(|v| (v.name, v.compression)).collect();
    let expected = [("plain", "lz4"), ("raw", "off"), ("small", "zstd")];
    assert_eq!(listed, expected.map(|(name, c)| (name.to_owned(), c.to_owned())));

    let changed = client.set_compression("plain", "off").unwrap();
    assert_eq!((changed.name.as_str(), changed.compression.as_str()), ("plain", "off"));
    assert_eq!(client.volume("plain").unwrap().compression, "off");
    assert_api_error(client.set_compression("plain", "lz5"), ErrorCode::InvalidRequest, "lz5");
    assert_api_error(client.set_compression("nope", "off"), ErrorCode::VolumeNotFound, "nope");
    let info = client.node().unwrap();
    assert_eq!(info.capacity.data_reduction, 1.0, "nothing stored");
    let scrub = info.scrub.expect("the node reports its scrub");
    assert_eq!(scrub.state, "off", "the fixture data path scrubs nothing");
    node.stop().unwrap();

    let probe_again = Arc::new(Probe::default());
    let node = start(dir.path(), &probe_again);
    let started: Vec<(String, meta::Compression)> = probe_again
        .started_records
        .lock()
        .unwrap()
        .iter()
        .map(|record| (record.name.to_string(), record.compression))
        .collect();
    let expected = [
        ("plain", meta::Compression::Off),
        ("raw", meta::Compression::Off),
        ("small", meta::Compression::Zstd),
    ];
    assert_eq!(started, expected.map(|(name, c)| (name.to_owned(), c)));
    node.stop().unwrap();
}
