//! Prometheus metrics: cheap to record on the data path, rendered only when scraped.
//!
//! Hot path: `VolumeMetrics::record_*` run on every I/O command, from any data-path thread. They
//! touch only relaxed atomic counters in a per-volume struct the caller already holds an `Arc`
//! to: no lock, no allocation, no syscall. The [`Registry`]'s lock is taken only when a volume is
//! registered or removed and when `/metrics` is scraped.
//!
//! Rendering writes the Prometheus text exposition format (version 0.0.4) by hand: a few
//! counters, gauges and fixed-bucket histograms do not justify a metrics framework.
//!
//! Families:
//! - `ferrite_node_drive_backend{backend}` (gauge): 1 for the backend holding the drives
//!   (`file`, or `memory`: NOT DURABLE), 0 for the others
//! - `ferrite_drive_failed{drive,path}` (gauge): 1 for a drive latched failed (no I/O reaches
//!   it until the node restarts), 0 for a drive in service
//! - `ferrite_volumes` (gauge), `ferrite_capacity_total_bytes`, `ferrite_capacity_free_bytes`,
//!   `ferrite_provisioned_bytes`, `ferrite_mapped_bytes`, `ferrite_physical_used_bytes`,
//!   `ferrite_write_amplification` (gauges), `ferrite_checksum_errors_total` (counter)
//! - `ferrite_mapped_physical_bytes`, `ferrite_data_reduction_ratio` (gauges): drive space the
//!   mapped blocks take, and mapped bytes per byte of it (above 1 when compression saves space)
//! - `ferrite_scrub_blocks_verified_total`, `ferrite_scrub_errors_total`,
//!   `ferrite_scrub_passes_total` (counters): the background scrub since the node started;
//!   `ferrite_scrub_slowed_for_hosts` (gauge): 1 while it reads at its busy rate because hosts
//!   keep the node busy
//! - `ferrite_erasure_data_shards`, `ferrite_erasure_parity_shards` (gauges): the node's
//!   erasure coding `k+m` (1 and 0 without parity)
//! - `ferrite_reads_reconstructed_total`, `ferrite_reads_repaired_total`,
//!   `ferrite_reads_unrecoverable_total` (counters): reads rebuilt from the other drives (their
//!   drive failed or could not be read), blocks that failed their checksum and were rebuilt
//!   intact, and reads that lost more than the parity covers
//! - `ferrite_rebuild_bytes_written_total` (counter): bytes drive rebuilds wrote;
//!   `ferrite_rebuild_segments_done`, `ferrite_rebuild_segments_total` (gauges): the rebuild in
//!   progress (both 0 when none runs); `ferrite_drive_rebuilding{drive,path}` (gauge): 1 for a
//!   drive being rebuilt; `ferrite_rebuild_slowed_for_hosts` (gauge): 1 while the rebuild writes
//!   at its busy rate because hosts keep the node busy
//! - `ferrite_replication_frames_sent_total`, `ferrite_replication_frames_received_total`,
//!   `ferrite_replication_frames_dropped_total` (counters, cluster nodes): replication messages
//!   to and from other nodes, and those dropped because a peer's link was full or down (the
//!   protocol sends them again); an acknowledgement that a newer one of the same stream
//!   replaced in the link's queue before it was written is not counted as sent;
//!   `ferrite_replication_reads_repaired_total`, `ferrite_replication_blocks_repaired_total`,
//!   `ferrite_replication_reads_unrecovered_total` (counters, cluster nodes): read repair
//!   across replicas, for the volumes this process holds: host reads whose blocks failed
//!   their checksum here and were served from an in-sync replica, the blocks rewritten here
//!   from those copies, and reads that found no good copy in sync;
//!   `ferrite_replication_damaged_blocks_found_total`,
//!   `ferrite_replication_damaged_blocks_rewritten_total` (counters, cluster nodes): blocks the
//!   scrub found damaged here (each then repaired from another copy), and of them those a
//!   write has replaced since; `ferrite_replication_reconcile_blocks_repaired_total`,
//!   `ferrite_replication_reconcile_unrecovered_total` (counters, cluster nodes): blocks a
//!   reconciliation after a failover found damaged on this node as the new primary and took
//!   from another member, and reconciliations that found no member with a good copy (the node
//!   then stopped serving the volume, as on an I/O error);
//!   `ferrite_replication_entries_refused_total` (counter, cluster nodes): writes refused as a
//!   replica because their blocks lay beyond this node's copy of the volume (a size that
//!   differs from the primary's: for a moment after a grow, until this node has grown too,
//!   and the primary sends them again) or their length was invalid;
//!   `ferrite_replication_storage_probes_total` (counter, cluster nodes): write intents this
//!   node persisted as primary only to learn whether its own storage takes writes while a
//!   replica was late (a pause of storage the nodes share removes no replica);
//!   `ferrite_lease_lapses_total`, `ferrite_lease_renewals_failed_total` (counters, cluster
//!   nodes): times this node's lease lapsed (it then served no volume as primary until a
//!   renewal was answered; the log has a warning for each) and renewals that failed;
//!   `ferrite_volume_replication_epoch{volume_id}` and `ferrite_volume_serving{volume_id}`
//!   (gauges): each replicated volume's epoch as this node
//!   knows it, and 1 while this node serves it
//! - `ferrite_volume_mapped_bytes{volume,volume_id}`,
//!   `ferrite_volume_physical_used_bytes{volume,volume_id}` (gauges): each volume's written
//!   bytes and the drive space they take
//! - `ferrite_host_bytes_written_total`, `ferrite_device_bytes_written_total`,
//!   `ferrite_log_batches_total`, `ferrite_log_batch_blocks_total`, `ferrite_drive_syncs_total`,
//!   `ferrite_gc_relocated_blocks_total`, `ferrite_gc_segments_cleaned_total`,
//!   `ferrite_gc_segments_cleaned_inline_total`,
//!   `ferrite_defrag_relocated_blocks_total`, `ferrite_segments_laid_out_total`,
//!   `ferrite_laid_out_bytes_total`,
//!   `ferrite_checkpoints_total`, `ferrite_checkpoint_bytes_written_total` (counters): the engine's traffic since the node started
//! - `ferrite_volume_operations_total{volume,volume_id,op}` (counter), `op` one of `read`,
//!   `write`, `flush`, `write_zeroes`, `deallocate`
//! - `ferrite_volume_bytes_total{volume,volume_id,op}` (counter), all but `flush`
//! - `ferrite_volume_errors_total{volume,volume_id}` (counter): commands the storage failed
//! - `ferrite_volume_latency_seconds{volume,volume_id,op}` (histogram), `op` `read` or `write`
//! - `ferrite_replication_storage_write_seconds{volume,volume_id}` (histogram, cluster nodes,
//!   once the volume has had one): each replicated write's local log write, from its start to
//!   durable; on the primary its own copy of a host write, on a replica an entry it appends
//! - `ferrite_replication_intent_persist_seconds{volume,volume_id}` (histogram, cluster nodes,
//!   once the volume has had one): each persist of the volume's write intent (its file
//!   written, synced and renamed), which writes to regions not yet in the intent wait for
//! - `ferrite_replication_ack_seconds{volume,volume_id,replica}` (histogram, cluster nodes, on
//!   the primary): from an entry's frame queued for replica `replica` (the member's name, or
//!   `n<id>` when the control store does not answer) to the
//!   replica's acknowledgement of it reaching this node's replication service. Beside the host
//!   write latency and the storage writes, it shows where a replicated write's time goes

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use types::VolumeName;

use crate::config::DriveBackend;
use crate::data_plane::{data_reduction, DriveStatus, EngineCounters, ErasureReport, VolumeSpace};

/// Upper bounds of the latency histogram buckets, in microseconds; a last `+Inf` bucket follows.
/// From local NVMe (tens of microseconds) to a stalled drive (a second).
pub const LATENCY_BUCKET_BOUNDS_US: [u64; 14] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
];
const BUCKET_COUNT: usize = LATENCY_BUCKET_BOUNDS_US.len() + 1;

const _: () = {
    let mut index = 1;
    while index < LATENCY_BUCKET_BOUNDS_US.len() {
        assert!(LATENCY_BUCKET_BOUNDS_US[index - 1] < LATENCY_BUCKET_BOUNDS_US[index]);
        index += 1;
    }
};

/// The I/O operations counted per volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
    Flush,
    WriteZeroes,
    Deallocate,
}

impl Operation {
    pub const ALL: [Operation; 5] =
        [Self::Read, Self::Write, Self::Flush, Self::WriteZeroes, Self::Deallocate];

    /// The `op` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Flush => "flush",
            Self::WriteZeroes => "write_zeroes",
            Self::Deallocate => "deallocate",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    fn moves_bytes(self) -> bool {
        self != Self::Flush
    }
}

/// `duration` in whole microseconds, as the histograms take it (saturating).
pub fn micros(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// A latency histogram with fixed buckets; each bucket counts the samples that fell into it
/// alone, and rendering accumulates them as Prometheus wants.
#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKET_COUNT],
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn record(&self, latency_us: u64) {
        let index = LATENCY_BUCKET_BOUNDS_US.partition_point(|&bound| bound < latency_us);
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(latency_us, Ordering::Relaxed);
    }

    /// Samples recorded so far.
    pub fn count(&self) -> u64 {
        self.buckets
            .iter()
            .fold(0u64, |total, bucket| total.wrapping_add(bucket.load(Ordering::Relaxed)))
    }

    /// Cumulative counts per bucket (the last is `+Inf`, the total count) and the sum in µs.
    pub fn snapshot(&self) -> ([u64; BUCKET_COUNT], u64) {
        let mut cumulative = [0; BUCKET_COUNT];
        let mut total = 0u64;
        for (slot, bucket) in cumulative.iter_mut().zip(&self.buckets) {
            total = total.wrapping_add(bucket.load(Ordering::Relaxed));
            *slot = total;
        }
        (cumulative, self.sum_us.load(Ordering::Relaxed))
    }
}

/// The counters of one volume. The data path holds an `Arc` to it and records every command.
#[derive(Default)]
pub struct VolumeMetrics {
    operations: [AtomicU64; Operation::ALL.len()],
    bytes: [AtomicU64; Operation::ALL.len()],
    read_latency: Histogram,
    write_latency: Histogram,
    errors: AtomicU64,
    /// Replicated volumes: each replicated write's local log write (either role).
    replicated_write_latency: Histogram,
    /// Replicated volumes: each persist of the write intent (file written, synced, renamed).
    intent_persist_latency: Histogram,
    /// The primary's wait for each replica's acknowledgements, by replica node id, oldest
    /// first; at most [`REPLICA_ACK_SERIES_MAX`]. Locked once per replica and scrape, never
    /// per write: the replication service keeps the `Arc`s it was given.
    replica_acks: Mutex<Vec<(u32, Arc<Histogram>)>>,
}

/// Replicas whose acknowledgement latency one volume's metrics keep: a volume has at most two
/// replicas at a time, so this covers several replacements; beyond it the oldest is forgotten.
pub const REPLICA_ACK_SERIES_MAX: usize = 8;

impl VolumeMetrics {
    pub fn record_read(&self, bytes: u64, latency_us: u64) {
        self.count(Operation::Read, bytes);
        self.read_latency.record(latency_us);
    }

    pub fn record_write(&self, bytes: u64, latency_us: u64) {
        self.count(Operation::Write, bytes);
        self.write_latency.record(latency_us);
    }

    pub fn record_flush(&self) {
        self.count(Operation::Flush, 0);
    }

    pub fn record_write_zeroes(&self, bytes: u64) {
        self.count(Operation::WriteZeroes, bytes);
    }

    pub fn record_deallocate(&self, bytes: u64) {
        self.count(Operation::Deallocate, bytes);
    }

    /// A command the storage failed (the host got an error status).
    pub fn record_error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    pub fn operations(&self, operation: Operation) -> u64 {
        self.operations[operation.index()].load(Ordering::Relaxed)
    }

    pub fn bytes(&self, operation: Operation) -> u64 {
        self.bytes[operation.index()].load(Ordering::Relaxed)
    }

    pub fn read_latency(&self) -> &Histogram {
        &self.read_latency
    }

    pub fn write_latency(&self) -> &Histogram {
        &self.write_latency
    }

    /// A replicated write's local log write took `latency_us`, start to durable.
    pub fn record_replicated_write(&self, latency_us: u64) {
        self.replicated_write_latency.record(latency_us);
    }

    pub fn replicated_write_latency(&self) -> &Histogram {
        &self.replicated_write_latency
    }

    /// A persist of the volume's write intent took `latency_us`, from its start to the file
    /// synced and renamed (the writes and stream entries waiting for it wait that long).
    pub fn record_intent_persist(&self, latency_us: u64) {
        self.intent_persist_latency.record(latency_us);
    }

    /// The histogram of replica `node`'s acknowledgement latency, made on first use.
    pub fn replica_ack_latency(&self, node: u32) -> Arc<Histogram> {
        let mut acks = self.replica_acks.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, histogram)) = acks.iter().find(|(id, _)| *id == node) {
            return Arc::clone(histogram);
        }
        if acks.len() >= REPLICA_ACK_SERIES_MAX {
            acks.remove(0);
        }
        let histogram = Arc::new(Histogram::default());
        acks.push((node, Arc::clone(&histogram)));
        histogram
    }

    /// Every replica's acknowledgement histogram, by node id.
    fn replica_ack_latencies(&self) -> Vec<(u32, Arc<Histogram>)> {
        self.replica_acks.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn count(&self, operation: Operation, bytes: u64) {
        self.operations[operation.index()].fetch_add(1, Ordering::Relaxed);
        if bytes != 0 {
            self.bytes[operation.index()].fetch_add(bytes, Ordering::Relaxed);
        }
    }
}

/// Node-wide values read from the control plane at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeGauges {
    pub drive_backend: DriveBackend,
    pub volumes: u64,
    pub capacity_total_bytes: u64,
    pub capacity_free_bytes: u64,
    pub provisioned_bytes: u64,
    pub mapped_bytes: u64,
    pub physical_used_bytes: u64,
    pub write_amplification: f64,
    pub checksum_errors: u64,
    /// Drive space the mapped blocks take (less than `mapped_bytes` when compressed).
    pub mapped_physical_bytes: u64,
    /// Every drive and whether it is latched failed.
    pub drives: Vec<DriveStatus>,
    pub counters: EngineCounters,
    pub scrub_blocks_verified: u64,
    pub scrub_errors: u64,
    pub scrub_passes: u64,
    /// Whether the scrub reads at its busy rate now, hosts keeping the node busy.
    pub scrub_slowed_for_hosts: bool,
    /// Erasure coding, degraded reads and rebuilds.
    pub erasure: ErasureReport,
    /// The space of each volume the data path knows, by volume id.
    pub volume_space: BTreeMap<u64, VolumeSpace>,
    /// On a cluster node, its replication traffic and volumes.
    pub replication: Option<ReplicationGauges>,
}

/// A cluster node's replication, read at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplicationGauges {
    pub frames_sent: u64,
    pub frames_received: u64,
    pub frames_dropped: u64,
    /// Each replicated volume this node holds: (volume id, epoch, serving).
    pub volumes: Vec<(u64, u64, bool)>,
    /// Read repair, summed over the volumes this process holds: host reads of damaged blocks
    /// served from a replica, blocks rewritten from those copies, reads failed with no good
    /// copy in sync.
    pub reads_repaired: u64,
    pub blocks_repaired: u64,
    pub reads_unrecovered: u64,
    /// Blocks the scrub found damaged here, and of them those a write has since replaced.
    pub damaged_found: u64,
    pub damaged_rewritten: u64,
    /// Blocks a reconciliation found damaged here and took from another member, and
    /// reconciliations that found no member with a good copy (the node then stopped).
    pub reconcile_blocks_repaired: u64,
    pub reconcile_unrecovered: u64,
    /// Stream entries refused as a replica: blocks beyond this node's copy of the volume.
    pub entries_refused: u64,
    /// Storage probes this node made as primary while a replica was late.
    pub storage_probes: u64,
    /// Times this node's lease lapsed, and lease renewals that failed, since the process started.
    pub lease_lapses: u64,
    pub lease_renewals_failed: u64,
    /// The cluster's members' names by node id, for the `replica` label (empty when the
    /// control store could not be asked: the label is then `n<id>`).
    pub member_names: BTreeMap<u32, String>,
}

struct Entry {
    /// Known once the control plane registers the volume; unnamed entries render without it.
    name: Option<VolumeName>,
    metrics: Arc<VolumeMetrics>,
}

/// Every volume's metrics, by volume id.
#[derive(Default)]
pub struct Registry {
    volumes: Mutex<BTreeMap<u64, Entry>>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers volume `id` under its name and returns its metrics (the existing ones if the
    /// data path asked for them first).
    pub fn register_volume(&self, id: u64, name: &VolumeName) -> Arc<VolumeMetrics> {
        let mut volumes = self.lock();
        let entry =
            volumes.entry(id).or_insert_with(|| Entry { name: None, metrics: Arc::default() });
        entry.name = Some(name.clone());
        Arc::clone(&entry.metrics)
    }

    /// The metrics of volume `id`, created if the volume is not registered yet. Called by the
    /// data path once per volume, not per command: it takes the registry's lock.
    pub fn volume(&self, id: u64) -> Arc<VolumeMetrics> {
        let mut volumes = self.lock();
        let entry =
            volumes.entry(id).or_insert_with(|| Entry { name: None, metrics: Arc::default() });
        Arc::clone(&entry.metrics)
    }

    /// Stops exporting volume `id`. Holders of its `Arc` may keep recording into it, unseen.
    pub fn remove_volume(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// The text exposition of every metric.
    pub fn render(&self, node: &NodeGauges) -> String {
        let volumes: Vec<(u64, Option<VolumeName>, Arc<VolumeMetrics>)> = self
            .lock()
            .iter()
            .map(|(id, entry)| (*id, entry.name.clone(), Arc::clone(&entry.metrics)))
            .collect();
        let mut out = String::new();
        family(
            &mut out,
            "ferrite_node_drive_backend",
            "gauge",
            "What holds the drives (1 for the one in use): file, or memory (NOT DURABLE: \
             every volume is lost when the node stops).",
        );
        for backend in [DriveBackend::File, DriveBackend::Memory] {
            let value = u8::from(backend == node.drive_backend);
            let name = backend.as_str();
            let _ = writeln!(out, "ferrite_node_drive_backend{{backend=\"{name}\"}} {value}");
        }
        family(
            &mut out,
            "ferrite_drive_failed",
            "gauge",
            "1 if the drive is latched failed after a failed write, sync or punch (no I/O \
             reaches it until the node restarts; every write to the node fails), 0 if in service.",
        );
        for drive in &node.drives {
            let mut path = String::new();
            escape_label_value(&mut path, &drive.path.display().to_string());
            let value = u8::from(drive.failed);
            let index = drive.index;
            let _ =
                writeln!(out, "ferrite_drive_failed{{drive=\"{index}\",path=\"{path}\"}} {value}");
        }
        family(
            &mut out,
            "ferrite_drive_rebuilding",
            "gauge",
            "1 if the drive is a replacement being rebuilt from the other drives, 0 otherwise.",
        );
        for drive in &node.drives {
            let mut path = String::new();
            escape_label_value(&mut path, &drive.path.display().to_string());
            let value = u8::from(drive.rebuild_percent.is_some());
            let index = drive.index;
            let _ = writeln!(
                out,
                "ferrite_drive_rebuilding{{drive=\"{index}\",path=\"{path}\"}} {value}"
            );
        }
        let erasure = &node.erasure;
        render_gauge(
            &mut out,
            "ferrite_erasure_data_shards",
            "Data blocks per stripe of the node's erasure coding (k of k+m).",
            u64::from(erasure.scheme.data_shards()),
        );
        render_gauge(
            &mut out,
            "ferrite_erasure_parity_shards",
            "Parity blocks per stripe (m of k+m): the drives the node may lose without losing data.",
            u64::from(erasure.scheme.parity_shards()),
        );
        let rebuild = erasure.rebuild.as_ref();
        render_gauge(
            &mut out,
            "ferrite_rebuild_segments_done",
            "Log segments the drive rebuild in progress has examined (0 when none runs).",
            rebuild.map_or(0, |rebuild| u64::from(rebuild.segments_done)),
        );
        render_gauge(
            &mut out,
            "ferrite_rebuild_segments_total",
            "Log segments the drive rebuild in progress examines in all (0 when none runs).",
            rebuild.map_or(0, |rebuild| u64::from(rebuild.segments_total)),
        );
        render_gauge(
            &mut out,
            "ferrite_rebuild_slowed_for_hosts",
            "1 while the drive rebuild in progress writes at its busy rate, hosts keeping the node busy.",
            u64::from(rebuild.is_some_and(|rebuild| rebuild.slowed_for_hosts)),
        );
        render_gauge(&mut out, "ferrite_volumes", "Volumes on this node.", node.volumes);
        render_gauge(
            &mut out,
            "ferrite_scrub_slowed_for_hosts",
            "1 while the background scrub reads at its busy rate, hosts keeping the node busy.",
            u64::from(node.scrub_slowed_for_hosts),
        );
        render_gauge(
            &mut out,
            "ferrite_capacity_total_bytes",
            "Drive space of this node.",
            node.capacity_total_bytes,
        );
        render_gauge(
            &mut out,
            "ferrite_capacity_free_bytes",
            "Space hosts may still write (capacity less mapped).",
            node.capacity_free_bytes,
        );
        render_gauge(
            &mut out,
            "ferrite_provisioned_bytes",
            "Sum of the volumes' sizes (thin: may exceed the capacity).",
            node.provisioned_bytes,
        );
        render_gauge(
            &mut out,
            "ferrite_mapped_bytes",
            "Volume bytes written and not deallocated.",
            node.mapped_bytes,
        );
        render_gauge(
            &mut out,
            "ferrite_physical_used_bytes",
            "Drive space in use (live data, garbage not yet collected, checkpoints).",
            node.physical_used_bytes,
        );
        family(
            &mut out,
            "ferrite_write_amplification",
            "gauge",
            "Device bytes written per host byte written.",
        );
        let _ = writeln!(out, "ferrite_write_amplification {}", node.write_amplification);
        family(
            &mut out,
            "ferrite_checksum_errors_total",
            "counter",
            "Blocks that failed their checksum when read (returned as errors, never as data).",
        );
        let _ = writeln!(out, "ferrite_checksum_errors_total {}", node.checksum_errors);
        render_gauge(
            &mut out,
            "ferrite_mapped_physical_bytes",
            "Drive space the mapped blocks take (less than the mapped bytes when compressed).",
            node.mapped_physical_bytes,
        );
        family(
            &mut out,
            "ferrite_data_reduction_ratio",
            "gauge",
            "Mapped bytes per byte they take on the drives (1 when compression saves nothing).",
        );
        let ratio = data_reduction(node.mapped_bytes, node.mapped_physical_bytes);
        let _ = writeln!(out, "ferrite_data_reduction_ratio {ratio}");
        let counters = &node.counters;
        for (name, help, value) in [
            (
                "ferrite_host_bytes_written_total",
                "Bytes hosts wrote (durable when counted).",
                counters.host_bytes_written,
            ),
            (
                "ferrite_device_bytes_written_total",
                "Bytes written to the drives: data, batch headers, GC copies, checkpoints.",
                counters.device_bytes_written,
            ),
            ("ferrite_log_batches_total", "Host batches made durable.", counters.host_batches),
            (
                "ferrite_log_batch_blocks_total",
                "Host blocks those batches carried (blocks per batch: the group-commit width).",
                counters.host_batch_blocks,
            ),
            (
                "ferrite_drive_syncs_total",
                "Drive syncs issued (fdatasyncs and durable O_DSYNC writes).",
                counters.drive_syncs,
            ),
            (
                "ferrite_gc_relocated_blocks_total",
                "Live blocks garbage collection copied.",
                counters.gc_relocated_blocks,
            ),
            (
                "ferrite_defrag_relocated_blocks_total",
                "Scattered blocks rewritten back to back after a host read them together.",
                counters.defrag_relocated_blocks,
            ),
            (
                "ferrite_segments_laid_out_total",
                "Free log segments laid out ahead of the log (holes of drive files filled).",
                counters.segments_laid_out,
            ),
            (
                "ferrite_laid_out_bytes_total",
                "Zeros written over holes of drive files to lay out free segments (not host data).",
                counters.laid_out_bytes,
            ),
            (
                "ferrite_gc_segments_cleaned_total",
                "Segments garbage collection freed.",
                counters.gc_segments_cleaned,
            ),
            (
                "ferrite_gc_segments_cleaned_inline_total",
                "Segments host writes cleaned themselves, finding no free segment beyond the reserve (their thread's writes waited meanwhile: background GC fell behind).",
                counters.gc_segments_cleaned_inline,
            ),
            ("ferrite_checkpoints_total", "Index checkpoints written.", counters.checkpoints),
            (
                "ferrite_checkpoint_bytes_written_total",
                "Bytes of index checkpoints written (part of the device bytes written).",
                counters.checkpoint_bytes_written,
            ),
            (
                "ferrite_scrub_blocks_verified_total",
                "Blocks the background scrub read back and found intact.",
                node.scrub_blocks_verified,
            ),
            (
                "ferrite_scrub_errors_total",
                "Damage the background scrub found (counted in each pass that finds it).",
                node.scrub_errors,
            ),
            (
                "ferrite_scrub_passes_total",
                "Full passes of the background scrub over the node's data.",
                node.scrub_passes,
            ),
            (
                "ferrite_reads_reconstructed_total",
                "Reads rebuilt from the other drives because their drive failed or could not be \
                 read.",
                erasure.reconstructed_reads,
            ),
            (
                "ferrite_reads_repaired_total",
                "Reads of a block that failed its checksum, rebuilt intact from parity.",
                erasure.repaired_reads,
            ),
            (
                "ferrite_reads_unrecoverable_total",
                "Reads that failed: their stripe lost more cells than the parity covers.",
                erasure.unrecoverable_reads,
            ),
            (
                "ferrite_rebuild_bytes_written_total",
                "Bytes drive rebuilds wrote to replacement drives.",
                erasure.rebuild_bytes_written_total,
            ),
        ] {
            family(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {value}");
        }

        if let Some(replication) = &node.replication {
            for (name, help, value) in [
                (
                    "ferrite_replication_frames_sent_total",
                    "Replication messages queued to other nodes.",
                    replication.frames_sent,
                ),
                (
                    "ferrite_replication_frames_received_total",
                    "Replication messages received from other nodes.",
                    replication.frames_received,
                ),
                (
                    "ferrite_replication_frames_dropped_total",
                    "Replication messages dropped because a peer's link was full or down (the \
                     protocol sends them again).",
                    replication.frames_dropped,
                ),
                (
                    "ferrite_replication_reads_repaired_total",
                    "Host reads whose blocks failed their checksum on this node and were served \
                     from an in-sync replica's copy (read repair), since the process started.",
                    replication.reads_repaired,
                ),
                (
                    "ferrite_replication_blocks_repaired_total",
                    "Blocks this node rewrote from a replica's copy after read repair.",
                    replication.blocks_repaired,
                ),
                (
                    "ferrite_replication_damaged_blocks_found_total",
                    "Blocks of replicated volumes the scrub found damaged on this node, each \
                     then repaired from another copy.",
                    replication.damaged_found,
                ),
                (
                    "ferrite_replication_damaged_blocks_rewritten_total",
                    "Blocks known damaged on this node that a write has since replaced (a copy \
                     from a replica or the primary, or a host write).",
                    replication.damaged_rewritten,
                ),
                (
                    "ferrite_replication_reads_unrecovered_total",
                    "Host reads failed because blocks were damaged here and no in-sync replica \
                     had another copy.",
                    replication.reads_unrecovered,
                ),
                (
                    "ferrite_replication_reconcile_blocks_repaired_total",
                    "Blocks a reconciliation after a failover found damaged on this node, the \
                     new primary, and took from another member.",
                    replication.reconcile_blocks_repaired,
                ),
                (
                    "ferrite_replication_reconcile_unrecovered_total",
                    "Reconciliations that stopped this node because no member had a good copy \
                     of a block damaged here.",
                    replication.reconcile_unrecovered,
                ),
                (
                    "ferrite_replication_entries_refused_total",
                    "Writes refused as a replica because their blocks lay beyond this node's \
                     copy of the volume (its size differs from the primary's) or their length \
                     was invalid.",
                    replication.entries_refused,
                ),
                (
                    "ferrite_replication_storage_probes_total",
                    "Write intents persisted as primary only to learn whether this node's own \
                     storage takes writes while a replica was late.",
                    replication.storage_probes,
                ),
                (
                    "ferrite_lease_lapses_total",
                    "Times this node's lease in the control store lapsed (no renewal answered \
                     within the lease): it then served none of its volumes as primary until a \
                     renewal was answered.",
                    replication.lease_lapses,
                ),
                (
                    "ferrite_lease_renewals_failed_total",
                    "Renewals of this node's lease that failed: the control store erred or did \
                     not answer within the renewal's timeout.",
                    replication.lease_renewals_failed,
                ),
            ] {
                family(&mut out, name, "counter", help);
                let _ = writeln!(out, "{name} {value}");
            }
            family(
                &mut out,
                "ferrite_volume_replication_epoch",
                "gauge",
                "The newest epoch of the replicated volume this node knows.",
            );
            for (id, epoch, _) in &replication.volumes {
                let _ =
                    writeln!(out, "ferrite_volume_replication_epoch{{volume_id=\"{id}\"}} {epoch}");
            }
            family(
                &mut out,
                "ferrite_volume_serving",
                "gauge",
                "1 while this node serves the replicated volume (its primary, ANA optimized).",
            );
            for (id, _, serving) in &replication.volumes {
                let value = u8::from(*serving);
                let _ = writeln!(out, "ferrite_volume_serving{{volume_id=\"{id}\"}} {value}");
            }
        }

        family(&mut out, "ferrite_volume_operations_total", "counter", "I/O commands completed.");
        for (id, name, metrics) in &volumes {
            for operation in Operation::ALL {
                let labels = labels(*id, name.as_ref(), operation);
                let value = metrics.operations(operation);
                let _ = writeln!(out, "ferrite_volume_operations_total{{{labels}}} {value}");
            }
        }

        family(
            &mut out,
            "ferrite_volume_errors_total",
            "counter",
            "I/O commands the storage failed.",
        );
        for (id, name, metrics) in &volumes {
            let labels = volume_labels(*id, name.as_ref());
            let _ = writeln!(out, "ferrite_volume_errors_total{{{labels}}} {}", metrics.errors());
        }

        for (family_name, help, value) in [
            (
                "ferrite_volume_mapped_bytes",
                "Bytes of the volume written and not deallocated.",
                (|space: &VolumeSpace| space.mapped_bytes) as fn(&VolumeSpace) -> u64,
            ),
            (
                "ferrite_volume_physical_used_bytes",
                "Drive space the volume's mapped blocks take (less when compressed).",
                |space: &VolumeSpace| space.physical_used_bytes,
            ),
        ] {
            family(&mut out, family_name, "gauge", help);
            for (id, name, _) in &volumes {
                let Some(space) = node.volume_space.get(id) else { continue };
                let labels = volume_labels(*id, name.as_ref());
                let _ = writeln!(out, "{family_name}{{{labels}}} {}", value(space));
            }
        }

        family(&mut out, "ferrite_volume_bytes_total", "counter", "Bytes moved by I/O commands.");
        for (id, name, metrics) in &volumes {
            for operation in Operation::ALL.into_iter().filter(|op| op.moves_bytes()) {
                let labels = labels(*id, name.as_ref(), operation);
                let value = metrics.bytes(operation);
                let _ = writeln!(out, "ferrite_volume_bytes_total{{{labels}}} {value}");
            }
        }

        const LATENCY: &str = "ferrite_volume_latency_seconds";
        family(&mut out, LATENCY, "histogram", "I/O command latency, from receipt to completion.");
        for (id, name, metrics) in &volumes {
            let histograms = [
                (Operation::Read, &metrics.read_latency),
                (Operation::Write, &metrics.write_latency),
            ];
            for (operation, histogram) in histograms {
                let labels = labels(*id, name.as_ref(), operation);
                render_histogram(&mut out, LATENCY, &labels, histogram);
            }
        }

        render_recorded(
            &mut out,
            &volumes,
            "ferrite_replication_storage_write_seconds",
            "A replicated write's local log write (the primary's copy or a replica's entry), \
             from its start to durable.",
            |metrics| &metrics.replicated_write_latency,
        );
        render_recorded(
            &mut out,
            &volumes,
            "ferrite_replication_intent_persist_seconds",
            "A persist of the volume's write intent (a file written, synced and renamed), which \
             the writes to regions not yet in it wait for: the primary's host writes, a \
             replica's stream entries.",
            |metrics| &metrics.intent_persist_latency,
        );

        const ACK: &str = "ferrite_replication_ack_seconds";
        let acks: Vec<_> = volumes
            .iter()
            .map(|(id, name, metrics)| (id, name, metrics.replica_ack_latencies()))
            .filter(|(_, _, acks)| !acks.is_empty())
            .collect();
        if !acks.is_empty() {
            family(
                &mut out,
                ACK,
                "histogram",
                "On the primary: from an entry's frame queued for a replica to the replica's \
                 acknowledgement of it.",
            );
            let names = node.replication.as_ref().map(|replication| &replication.member_names);
            for (id, name, replicas) in acks {
                for (replica, histogram) in replicas {
                    let mut labels = volume_labels(*id, name.as_ref());
                    labels.push_str(",replica=\"");
                    match names.and_then(|names| names.get(&replica)) {
                        Some(name) => escape_label_value(&mut labels, name),
                        None => {
                            let _ = write!(labels, "n{replica}");
                        }
                    }
                    labels.push('"');
                    render_histogram(&mut out, ACK, &labels, &histogram);
                }
            }
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Entry>> {
        // The map holds no invariant a panicking holder could break halfway.
        self.volumes.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The `_bucket`, `_sum` and `_count` series of one histogram with `labels` (without `le`).
/// The histogram family `name`, one series per volume that recorded a sample in it (`pick`);
/// nothing at all while none has, so a node without replicated volumes shows no such family.
fn render_recorded(
    out: &mut String,
    volumes: &[(u64, Option<VolumeName>, Arc<VolumeMetrics>)],
    name: &str,
    help: &str,
    pick: impl Fn(&VolumeMetrics) -> &Histogram,
) {
    let recorded: Vec<_> =
        volumes.iter().filter(|(_, _, metrics)| pick(metrics).count() > 0).collect();
    if recorded.is_empty() {
        return;
    }
    family(out, name, "histogram", help);
    for (id, name_label, metrics) in recorded {
        render_histogram(out, name, &volume_labels(*id, name_label.as_ref()), pick(metrics));
    }
}

fn render_histogram(out: &mut String, name: &str, labels: &str, histogram: &Histogram) {
    let (cumulative, sum_us) = histogram.snapshot();
    let bounds = LATENCY_BUCKET_BOUNDS_US.iter().map(|&us| Some(us)).chain([None]);
    for (bound_us, count) in bounds.zip(cumulative) {
        let le = match bound_us {
            Some(us) => seconds(us),
            None => "+Inf".to_owned(),
        };
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {count}");
    }
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", seconds(sum_us));
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", cumulative[BUCKET_COUNT - 1]);
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn render_gauge(out: &mut String, name: &str, help: &str, value: u64) {
    family(out, name, "gauge", help);
    let _ = writeln!(out, "{name} {value}");
}

/// `volume="NAME",volume_id="ID"` (without the name while the volume is not registered).
fn volume_labels(id: u64, name: Option<&VolumeName>) -> String {
    let mut labels = String::new();
    if let Some(name) = name {
        labels.push_str("volume=\"");
        escape_label_value(&mut labels, name.as_str());
        labels.push_str("\",");
    }
    let _ = write!(labels, "volume_id=\"{id}\"");
    labels
}

fn labels(id: u64, name: Option<&VolumeName>, operation: Operation) -> String {
    let mut labels = volume_labels(id, name);
    let _ = write!(labels, ",op=\"{}\"", operation.as_str());
    labels
}

/// Escapes a label value as the exposition format requires (backslash, quote, newline).
/// Volume names never contain these, but the format must hold whatever a name becomes.
fn escape_label_value(out: &mut String, value: &str) {
    for character in value.chars() {
        match character {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            other => out.push(other),
        }
    }
}

/// Microseconds as decimal seconds, exactly: `250` -> `0.00025`, `2_000_000` -> `2`.
fn seconds(microseconds: u64) -> String {
    let whole = microseconds / 1_000_000;
    let fraction = microseconds % 1_000_000;
    if fraction == 0 {
        return whole.to_string();
    }
    let digits = format!("{fraction:06}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> u64 {
        let line = text
            .lines()
            .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
            .unwrap_or_else(|| panic!("no series {series} in\n{text}"));
        line[series.len() + 1..].parse().unwrap()
    }

    #[test]
    fn seconds_are_exact() {
        let check = |us: u64, expect: &str| assert_eq!(seconds(us), expect);
        check(0, "0");
        check(25, "0.000025");
        check(250, "0.00025");
        check(1_000_000, "1");
        check(2_500_001, "2.500001");
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_inclusive() {
        let histogram = Histogram::default();
        for latency_us in [0, 25, 26, 1_000_000, 1_000_001, u64::MAX / 4] {
            histogram.record(latency_us);
        }
        let (cumulative, _) = histogram.snapshot();
        assert_eq!(cumulative[0], 2, "le=25us holds 0 and 25");
        assert_eq!(cumulative[1], 3, "le=50us adds 26");
        assert_eq!(cumulative[BUCKET_COUNT - 2], 4, "le=1s adds 1s");
        assert_eq!(cumulative[BUCKET_COUNT - 1], 6, "+Inf holds everything");
    }

    #[test]
    fn concurrent_recording_loses_nothing() {
        const THREADS: u64 = 4;
        const COMMANDS: u64 = 10_000;
        let registry = Registry::new();
        let metrics = registry.register_volume(7, &VolumeName::new("db").unwrap());
        std::thread::scope(|scope| {
            for _ in 0..THREADS {
                scope.spawn(|| {
                    for command in 0..COMMANDS {
                        metrics.record_read(4096, command % 2000);
                        metrics.record_write(8192, 30);
                    }
                });
            }
        });
        assert!(Arc::ptr_eq(&metrics, &registry.volume(7)));
        let text = registry.render(&NodeGauges::default());
        let labels = "volume=\"db\",volume_id=\"7\"";
        let reads = THREADS * COMMANDS;
        assert_eq!(
            value(&text, &format!("ferrite_volume_operations_total{{{labels},op=\"read\"}}")),
            reads
        );
        assert_eq!(
            value(&text, &format!("ferrite_volume_bytes_total{{{labels},op=\"write\"}}")),
            reads * 8192
        );
        assert_eq!(
            value(&text, &format!("ferrite_volume_latency_seconds_count{{{labels},op=\"read\"}}")),
            reads
        );
        assert_eq!(
            value(
                &text,
                &format!(
                    "ferrite_volume_latency_seconds_bucket{{{labels},op=\"write\",le=\"0.00005\"}}"
                )
            ),
            reads
        );
        assert_eq!(
            value(
                &text,
                &format!("ferrite_volume_latency_seconds_bucket{{{labels},op=\"write\",le=\"0.000025\"}}")
            ),
            0
        );
    }

    #[test]
    fn replication_latencies_appear_once_recorded_and_keep_a_bounded_set_of_replicas() {
        let registry = Registry::new();
        let metrics = registry.register_volume(4, &VolumeName::new("db").unwrap());
        registry.register_volume(5, &VolumeName::new("idle").unwrap());
        let text = registry.render(&NodeGauges::default());
        assert!(!text.contains("ferrite_replication_storage_write_seconds"), "{text}");
        assert!(!text.contains("ferrite_replication_ack_seconds"), "{text}");

        metrics.record_replicated_write(700);
        metrics.record_replicated_write(3_000);
        assert!(!registry.render(&NodeGauges::default()).contains("intent_persist"));
        metrics.record_intent_persist(40_000);
        let first = metrics.replica_ack_latency(2);
        first.record(1_200);
        assert!(Arc::ptr_eq(&first, &metrics.replica_ack_latency(2)), "one series per replica");
        metrics.replica_ack_latency(3).record(40);
        let text = registry.render(&NodeGauges::default());
        let labels = "volume=\"db\",volume_id=\"4\"";
        let storage = "ferrite_replication_storage_write_seconds";
        assert_eq!(value(&text, &format!("{storage}_count{{{labels}}}")), 2);
        assert_eq!(value(&text, &format!("{storage}_bucket{{{labels},le=\"0.001\"}}")), 1);
        assert_eq!(value(&text, &format!("{storage}_bucket{{{labels},le=\"0.0025\"}}")), 1);
        assert_eq!(value(&text, &format!("{storage}_bucket{{{labels},le=\"+Inf\"}}")), 2);
        assert!(text.contains(&format!("{storage}_sum{{{labels}}} 0.0037\n")), "{text}");
        let intent = "ferrite_replication_intent_persist_seconds";
        assert_eq!(value(&text, &format!("{intent}_count{{{labels}}}")), 1);
        assert!(text.contains(&format!("{intent}_sum{{{labels}}} 0.04\n")), "{text}");
        assert!(!text.contains(&format!("{intent}_count{{volume=\"idle\"")), "{text}");
        let ack = "ferrite_replication_ack_seconds";
        assert_eq!(value(&text, &format!("{ack}_count{{{labels},replica=\"n2\"}}")), 1);
        assert_eq!(
            value(&text, &format!("{ack}_bucket{{{labels},replica=\"n3\",le=\"0.00005\"}}")),
            1
        );
        assert!(!text.contains("volume=\"idle\",volume_id=\"5\",replica"), "{text}");
        assert_eq!(text.matches("# TYPE ferrite_replication_ack_seconds histogram").count(), 1);
        let named = NodeGauges {
            replication: Some(ReplicationGauges {
                member_names: [(2, "node-\"b".to_owned())].into(),
                ..ReplicationGauges::default()
            }),
            ..NodeGauges::default()
        };
        let text = registry.render(&named);
        assert_eq!(value(&text, &format!("{ack}_count{{{labels},replica=\"node-\\\"b\"}}")), 1);
        assert_eq!(value(&text, &format!("{ack}_count{{{labels},replica=\"n3\"}}")), 1);

        // Replacements beyond the bound forget the oldest replica's series.
        for node in 10..10 + REPLICA_ACK_SERIES_MAX as u32 - 1 {
            metrics.replica_ack_latency(node);
        }
        assert_eq!(metrics.replica_ack_latencies().len(), REPLICA_ACK_SERIES_MAX);
        assert!(!metrics.replica_ack_latencies().iter().any(|(node, _)| *node == 2));
        assert!(metrics.replica_ack_latencies().iter().any(|(node, _)| *node == 3));
    }

    #[test]
    fn exposition_is_well_formed() {
        let registry = Registry::new();
        registry.register_volume(1, &VolumeName::new("a").unwrap()).record_flush();
        registry.volume(2).record_deallocate(1 << 20);
        registry.register_volume(3, &VolumeName::new("gone").unwrap());
        registry.remove_volume(3);
        let gauges = NodeGauges {
            volumes: 2,
            capacity_total_bytes: 1 << 30,
            capacity_free_bytes: 1 << 29,
            checksum_errors: 3,
            mapped_bytes: 3 << 20,
            mapped_physical_bytes: 1 << 20,
            scrub_blocks_verified: 77,
            scrub_errors: 1,
            scrub_passes: 2,
            scrub_slowed_for_hosts: true,
            replication: Some(ReplicationGauges {
                frames_sent: 10,
                frames_received: 9,
                frames_dropped: 1,
                volumes: vec![(1, 4, true)],
                reads_repaired: 3,
                blocks_repaired: 5,
                reads_unrecovered: 1,
                damaged_found: 4,
                damaged_rewritten: 2,
                reconcile_blocks_repaired: 6,
                reconcile_unrecovered: 7,
                entries_refused: 9,
                storage_probes: 8,
                lease_lapses: 2,
                lease_renewals_failed: 5,
                member_names: BTreeMap::new(),
            }),
            volume_space: [(
                1,
                VolumeSpace {
                    provisioned_bytes: 1 << 30,
                    mapped_bytes: 8192,
                    physical_used_bytes: 2048,
                },
            )]
            .into(),
            counters: EngineCounters {
                device_bytes_written: 5 << 20,
                host_batches: 7,
                ..EngineCounters::default()
            },
            drives: vec![
                DriveStatus {
                    index: 0,
                    path: "/dev/loop7".into(),
                    failed: false,
                    rebuild_percent: None,
                },
                DriveStatus {
                    index: 1,
                    path: "/srv/d\"1".into(),
                    failed: true,
                    rebuild_percent: None,
                },
                DriveStatus {
                    index: 2,
                    path: "/srv/d2".into(),
                    failed: false,
                    rebuild_percent: Some(40),
                },
            ],
            erasure: ErasureReport {
                scheme: engine::erasure::ErasureScheme::new(2, 1).unwrap(),
                reconstructed_reads: 11,
                repaired_reads: 2,
                unrecoverable_reads: 1,
                rebuild: Some(crate::data_plane::RebuildReport {
                    drive: 2,
                    segments_done: 40,
                    segments_total: 100,
                    bytes_written: 1 << 20,
                    elapsed_seconds: 1.0,
                    stalled: None,
                    slowed_for_hosts: true,
                }),
                rebuild_bytes_written_total: 3 << 20,
                ..ErasureReport::default()
            },
            ..NodeGauges::default()
        };
        let text = registry.render(&gauges);

        assert_eq!(value(&text, "ferrite_volumes"), 2);
        assert_eq!(value(&text, "ferrite_capacity_free_bytes"), 1 << 29);
        assert_eq!(value(&text, "ferrite_checksum_errors_total"), 3);
        assert_eq!(value(&text, "ferrite_device_bytes_written_total"), 5 << 20);
        assert_eq!(value(&text, "ferrite_log_batches_total"), 7);
        assert_eq!(value(&text, "ferrite_drive_syncs_total"), 0);
        assert_eq!(value(&text, "ferrite_mapped_physical_bytes"), 1 << 20);
        assert!(text.contains("ferrite_data_reduction_ratio 3\n"), "{text}");
        assert_eq!(value(&text, "ferrite_scrub_blocks_verified_total"), 77);
        assert_eq!(value(&text, "ferrite_scrub_errors_total"), 1);
        assert_eq!(value(&text, "ferrite_scrub_passes_total"), 2);
        assert_eq!(value(&text, "ferrite_scrub_slowed_for_hosts"), 1);
        assert_eq!(value(&text, "ferrite_replication_frames_dropped_total"), 1);
        assert_eq!(value(&text, "ferrite_replication_reads_repaired_total"), 3);
        assert_eq!(value(&text, "ferrite_replication_blocks_repaired_total"), 5);
        assert_eq!(value(&text, "ferrite_replication_reads_unrecovered_total"), 1);
        assert_eq!(value(&text, "ferrite_replication_reconcile_blocks_repaired_total"), 6);
        assert_eq!(value(&text, "ferrite_replication_reconcile_unrecovered_total"), 7);
        assert_eq!(value(&text, "ferrite_replication_entries_refused_total"), 9);
        assert_eq!(value(&text, "ferrite_replication_storage_probes_total"), 8);
        assert_eq!(value(&text, "ferrite_lease_lapses_total"), 2);
        assert_eq!(value(&text, "ferrite_lease_renewals_failed_total"), 5);
        assert_eq!(value(&text, "ferrite_replication_damaged_blocks_found_total"), 4);
        assert_eq!(value(&text, "ferrite_replication_damaged_blocks_rewritten_total"), 2);
        assert!(text.contains("ferrite_volume_serving{volume_id=\"1\"} 1\n"), "{text}");
        assert!(text.contains("ferrite_volume_replication_epoch{volume_id=\"1\"} 4\n"));
        assert_eq!(value(&text, "ferrite_volume_mapped_bytes{volume=\"a\",volume_id=\"1\"}"), 8192);
        assert_eq!(
            value(&text, "ferrite_volume_physical_used_bytes{volume=\"a\",volume_id=\"1\"}"),
            2048
        );
        assert!(
            !text.contains("ferrite_volume_mapped_bytes{volume_id=\"2\"}"),
            "no space, no series"
        );
        let empty = registry.render(&NodeGauges::default());
        assert!(empty.contains("ferrite_data_reduction_ratio 1\n"), "nothing stored: 1");
        assert!(text.contains("ferrite_write_amplification 0\n"), "{text}");
        assert_eq!(value(&text, "ferrite_node_drive_backend{backend=\"file\"}"), 1);
        assert_eq!(value(&text, "ferrite_drive_failed{drive=\"0\",path=\"/dev/loop7\"}"), 0);
        assert_eq!(value(&text, "ferrite_drive_failed{drive=\"1\",path=\"/srv/d\\\"1\"}"), 1);
        assert_eq!(value(&text, "ferrite_node_drive_backend{backend=\"memory\"}"), 0);
        assert_eq!(value(&text, "ferrite_drive_rebuilding{drive=\"2\",path=\"/srv/d2\"}"), 1);
        assert_eq!(value(&text, "ferrite_drive_rebuilding{drive=\"1\",path=\"/srv/d\\\"1\"}"), 0);
        assert_eq!(value(&text, "ferrite_erasure_data_shards"), 2);
        assert_eq!(value(&text, "ferrite_erasure_parity_shards"), 1);
        assert_eq!(value(&text, "ferrite_reads_reconstructed_total"), 11);
        assert_eq!(value(&text, "ferrite_reads_repaired_total"), 2);
        assert_eq!(value(&text, "ferrite_reads_unrecoverable_total"), 1);
        assert_eq!(value(&text, "ferrite_rebuild_bytes_written_total"), 3 << 20);
        assert_eq!(value(&text, "ferrite_rebuild_segments_done"), 40);
        assert_eq!(value(&text, "ferrite_rebuild_segments_total"), 100);
        assert_eq!(value(&empty, "ferrite_rebuild_segments_total"), 0, "none runs");
        assert_eq!(value(&text, "ferrite_rebuild_slowed_for_hosts"), 1);
        assert_eq!(value(&empty, "ferrite_rebuild_slowed_for_hosts"), 0, "none runs");
        assert_eq!(value(&empty, "ferrite_erasure_parity_shards"), 0);
        let memory = NodeGauges { drive_backend: DriveBackend::Memory, ..gauges.clone() };
        let memory_text = registry.render(&memory);
        assert_eq!(value(&memory_text, "ferrite_node_drive_backend{backend=\"memory\"}"), 1);
        assert_eq!(value(&memory_text, "ferrite_node_drive_backend{backend=\"file\"}"), 0);
        assert_eq!(
            value(
                &text,
                "ferrite_volume_operations_total{volume=\"a\",volume_id=\"1\",op=\"flush\"}"
            ),
            1
        );
        assert_eq!(
            value(&text, "ferrite_volume_bytes_total{volume_id=\"2\",op=\"deallocate\"}"),
            1 << 20
        );
        assert!(!text.contains("gone"), "removed volumes are not exported");
        assert!(!text.contains("op=\"flush\",le"), "flush has no histogram");

        let mut families = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(families.insert(name.to_owned()), "family {name} declared twice");
            } else if !line.starts_with("# HELP ") {
                let (series, value) = line.rsplit_once(' ').unwrap();
                assert!(value.parse::<f64>().is_ok(), "bad value in {line:?}");
                let name = series.split('{').next().unwrap();
                let family = name
                    .strip_suffix("_bucket")
                    .or_else(|| name.strip_suffix("_sum"))
                    .or_else(|| name.strip_suffix("_count"))
                    .filter(|family| families.contains(*family))
                    .unwrap_or(name);
                assert!(families.contains(family), "series {series} before its TYPE line");
                assert_eq!(series.matches('{').count(), series.matches('}').count(), "{line}");
            }
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let mut out = String::new();
        escape_label_value(&mut out, "a\"b\\c\nd");
        assert_eq!(out, "a\\\"b\\\\c\\nd");
    }
}
