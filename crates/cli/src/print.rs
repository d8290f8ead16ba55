//! What the CLI prints: aligned tables and key-value blocks for people, the API's JSON for
//! scripts (`--json` prints exactly what the API returned).

use api::{AccessMode, HostAccess, SnapshotInfo, VolumeInfo};
use types::ByteSize;

pub fn started(node: &node::Node) {
    let record = node.record();
    let memory = node.drive_backend() == node::DriveBackend::Memory;
    let external: Vec<String> =
        node.external_drives().iter().map(|path| path.display().to_string()).collect();
    let place = if memory {
        "RAM (memory backend)".to_owned()
    } else if !external.is_empty() {
        external.join(", ")
    } else {
        node.drives_dir().display().to_string()
    };
    let drives =
        format!("{} x {} in {place}", record.drive_count, ByteSize(record.drive_size_bytes));
    println!(
        "Ferrite node {} {}",
        api::format_uuid(&record.uuid),
        if node.first_start() { "created" } else { "started" }
    );
    println!("  REST API:  {}", node.api_url());
    println!("  NVMe/TCP:  {}", node.nvme_addr());
    match node.nbd_addr() {
        Some(addr) => println!("  NBD:       {addr}"),
        None => println!("  NBD:       off"),
    }
    println!("  drives:    {drives}");
    let erasure = node.erasure();
    println!(
        "  erasure:   {}",
        erasure_summary(
            &erasure.to_string(),
            erasure.data_shards(),
            erasure.parity_shards(),
            &erasure.protection()
        )
    );
    println!("  metadata:  {}", node.meta_path().display());
    if memory {
        println!("  WARNING:   {}", node::MEMORY_BACKEND_WARNING);
        println!("             (the metadata's scratch directory is removed at stop too)");
    }
    println!("Stop with Ctrl-C.");
}

pub fn node(json: bool, node: &api::NodeInfo) -> anyhow::Result<()> {
    if json {
        return print_json(node);
    }
    let capacity = &node.capacity;
    let rows = [
        ("node", node.node_uuid.clone()),
        ("version", node.version.clone()),
        ("created", api::rfc3339_utc(node.created_unix_ms)),
        ("nvme", format!("tcp {}:{}", node.nvme_host, node.nvme_port)),
        ("drives", format!("{} x {}", node.drive_count, ByteSize(node.drive_size_bytes))),
        ("drive backend", drive_backend(&node.drive_backend)),
        (
            "erasure coding",
            node.erasure.as_ref().map_or_else(
                || "unknown (the node does not report it)".to_owned(),
                |erasure| {
                    erasure_summary(
                        &erasure.scheme,
                        erasure.data_shards,
                        erasure.parity_shards,
                        &erasure.protection,
                    )
                },
            ),
        ),
        ("capacity", format!("{} total", ByteSize(capacity.total_bytes))),
        ("free", format!("{}", ByteSize(capacity.free_bytes))),
        ("provisioned", format!("{} (thin)", ByteSize(capacity.provisioned_bytes))),
        ("mapped", format!("{}", ByteSize(capacity.mapped_bytes))),
        ("used", format!("{} on the drives", ByteSize(capacity.physical_used_bytes))),
        (
            "data reduction",
            format!(
                "{} (mapped data takes {} on the drives)",
                reduction(capacity.data_reduction),
                ByteSize(capacity.mapped_physical_bytes)
            ),
        ),
        ("write amp", format!("{:.2}", capacity.write_amplification)),
        ("checksum errors", capacity.checksum_errors.to_string()),
        ("volumes", node.volume_count.to_string()),
    ];
    for (key, value) in rows {
        println!("{:<17}{value}", format!("{key}:"));
    }
    for drive in &node.drives {
        let key = format!("drive {}:", drive.index);
        let rebuilt = match drive.rebuild_percent {
            Some(percent) => format!(", {percent}% rebuilt"),
            None => String::new(),
        };
        println!(
            "{key:<17}{} {} ({}){rebuilt}",
            drive.state,
            drive_path(drive),
            ByteSize(drive.size_bytes)
        );
    }
    let failed: Vec<String> = node
        .drives
        .iter()
        .filter(|drive| drive.state == api::DRIVE_STATE_FAILED)
        .map(|drive| format!("{} ({})", drive.index, drive_path(drive)))
        .collect();
    if let Some(erasure) = &node.erasure {
        print_erasure(erasure);
    }
    if let Some(scrub) = &node.scrub {
        print_scrub(scrub);
    }
    if !failed.is_empty() {
        let parity = node.erasure.as_ref().map_or(0, |erasure| erasure.parity_shards);
        let first = node
            .drives
            .iter()
            .find(|drive| drive.state == api::DRIVE_STATE_FAILED)
            .map_or(0, |drive| drive.index);
        if parity == 0 {
            println!(
                "FAILED DRIVES:   drive {} failed: an I/O error or a failed sync latched it, and \
                 no I/O reaches it until the node restarts. Every write, write-zeroes and \
                 deallocate on this node now fails with an error (each write batch spans the \
                 drives); reads of data on the other drives still work, and reads of data on a \
                 failed drive fail with an error, never wrong data. This node has no parity, so \
                 the drive cannot be rebuilt: check the drive and the kernel log, then restart \
                 the node.",
                failed.join(", drive ")
            );
        } else if failed.len() <= usize::from(parity) {
            let margin = match usize::from(parity) - failed.len() {
                0 => "one more failed drive would lose data".to_owned(),
                more => format!("the node survives {more} more failed drive(s) only"),
            };
            println!(
                "DEGRADED:        drive {} failed (latched after an I/O error, or unreadable at \
                 start). Hosts see no difference: reads of its data are rebuilt from parity and \
                 writes go on without it. But {margin}: replace it with `ferrite drive replace \
                 {first}` (add --path NEW on a node on block devices) to rebuild it.",
                failed.join(", drive ")
            );
        } else {
            println!(
                "FAILED DRIVES:   drives {} failed, more than the {parity} the erasure coding \
                 covers: every write fails, and reads of stripes that lost more than {parity} \
                 drives fail with an error (never wrong data). Bring drives back and restart, \
                 or restore from a replica or a backup.",
                failed.join(", drive ")
            );
        }
    }
    Ok(())
}

/// A drive's path, or what stands for it when the node started without it (the API's empty
/// path: none of its `--drive` paths held the drive).
fn drive_path(drive: &api::DriveInfo) -> &str {
    if drive.path.is_empty() {
        "(no device: not among the --drive paths at start)"
    } else {
        &drive.path
    }
}

/// `k+m: what it survives; the share of raw space that holds data`.
fn erasure_summary(scheme: &str, data_shards: u8, parity_shards: u8, protection: &str) -> String {
    if parity_shards == 0 {
        return format!("none ({scheme}): {protection}");
    }
    let shards = u32::from(data_shards) + u32::from(parity_shards);
    let data_percent = (u32::from(data_shards) * 100 + shards / 2) / shards.max(1);
    format!("{scheme}: {protection}; {data_percent}% of the drive space holds data")
}

/// The rebuild and degraded-read lines of `node show`.
fn print_erasure(erasure: &api::ErasureInfo) {
    let mut rows = Vec::new();
    if let Some(rebuild) = &erasure.rebuild {
        let eta = rebuild
            .eta_seconds
            .map_or_else(String::new, |seconds| format!(", about {} left", duration(seconds)));
        let pace = match (erasure.rebuild_mb_per_s, erasure.rebuild_busy_mb_per_s) {
            (0, _) => "no limit".to_owned(),
            (_, busy) if rebuild.slowed_for_hosts => {
                format!("slowed to {busy} MiB/s while hosts are busy")
            }
            (limit, _) => format!("at most {limit} MiB/s"),
        };
        rows.push((
            "rebuild",
            format!(
                "drive {}: {:.0}% ({} of {} segments), {} written at {}/s ({pace}){eta}",
                rebuild.drive,
                rebuild.percent,
                rebuild.segments_done,
                rebuild.segments_total,
                mib(rebuild.bytes_written),
                mib(rebuild.bytes_per_second),
            ),
        ));
        if let Some(stalled) = &rebuild.stalled {
            rows.push(("rebuild stalled", format!("{stalled} (it retries)")));
        }
    }
    if let Some(last) = &erasure.last_rebuild {
        let outcome = if last.finished {
            format!(
                "drive {} rebuilt: {} in {:.1} s",
                last.drive,
                ByteSize(last.bytes_written),
                last.seconds
            )
        } else {
            format!(
                "drive {} FAILED after {:.1} s: {}; replace it again with `ferrite drive \
                 replace {}`",
                last.drive,
                last.seconds,
                last.error.as_deref().unwrap_or("unknown error"),
                last.drive
            )
        };
        rows.push(("last rebuild", outcome));
    }
    if erasure.parity_shards > 0 || erasure.reconstructed_reads > 0 {
        rows.push((
            "degraded reads",
            format!(
                "{} rebuilt from parity, {} repaired (bad checksum), {} unrecoverable",
                erasure.reconstructed_reads, erasure.repaired_reads, erasure.unrecoverable_reads
            ),
        ));
    }
    for (key, value) in rows {
        println!("{:<17}{value}", format!("{key}:"));
    }
}

/// Seconds for people: `45 s`, `12 min`, `3.5 h`.
fn duration(seconds: u64) -> String {
    match seconds {
        0..120 => format!("{seconds} s"),
        120..7200 => format!("{} min", seconds.div_ceil(60)),
        _ => format!("{:.1} h", seconds as f64 / 3600.0),
    }
}

/// After `ferrite drive replace`.
pub fn drive_replaced(json: bool, drive: &api::DriveInfo) -> anyhow::Result<()> {
    if json {
        return print_json(drive);
    }
    println!(
        "replaced drive {} with {}: it is being rebuilt from the other drives in the background",
        drive.index, drive.path
    );
    println!("  follow the rebuild with `ferrite node show`");
    Ok(())
}

/// A data-reduction ratio: `2.41x`.
fn reduction(ratio: f64) -> String {
    format!("{ratio:.2}x")
}

/// The scrub block of `node show`: its state, its counts, and what it found.
fn print_scrub(scrub: &api::ScrubInfo) {
    let state = match scrub.state.as_str() {
        api::SCRUB_STATE_RUNNING if scrub.slowed_for_hosts => format!(
            "running, pass {:.0}% done, slowed to {} MiB/s while hosts are busy",
            scrub.pass_progress_percent, scrub.busy_rate_mb_per_s
        ),
        api::SCRUB_STATE_RUNNING => {
            format!("running, pass {:.0}% done", scrub.pass_progress_percent)
        }
        api::SCRUB_STATE_WAITING => {
            "waiting for the next pass (one starts at most every minute)".to_owned()
        }
        api::SCRUB_STATE_PAUSED => "paused: a drive is latched failed; it resumes once the \
                                    drive is replaced or the node restarts"
            .to_owned(),
        api::SCRUB_STATE_OFF => "off (ferrite up --scrub-mb-per-s 0)".to_owned(),
        other => other.to_owned(),
    };
    let rows = [
        (
            "scrub",
            if scrub.rate_mb_per_s == 0 {
                state
            } else {
                format!(
                    "{state}; at most {} MiB/s, {} MiB/s while hosts are busy",
                    scrub.rate_mb_per_s, scrub.busy_rate_mb_per_s
                )
            },
        ),
        ("scrub passes", scrub.passes_completed.to_string()),
        ("scrub verified", format!("{} blocks", scrub.blocks_verified)),
        ("scrub errors", scrub.errors.to_string()),
    ];
    for (key, value) in rows {
        println!("{:<17}{value}", format!("{key}:"));
    }
    for finding in &scrub.findings {
        let what = match (finding.kind.as_str(), &finding.volume, finding.layer, finding.block) {
            (api::SCRUB_DAMAGE_BLOCK, Some(volume), _, Some(block)) => {
                format!("block {block} of volume {volume} is damaged (reads of it fail)")
            }
            (api::SCRUB_DAMAGE_BLOCK, None, Some(layer), Some(block)) => format!(
                "block {block} of snapshot/clone layer {layer} is damaged (reads of it fail)"
            ),
            (api::SCRUB_DAMAGE_HEADER, ..) => format!(
                "a batch header of segment {} did not decode and was rebuilt from parity",
                finding.segment.map_or_else(|| "?".to_owned(), |segment| segment.to_string())
            ),
            (api::SCRUB_DAMAGE_HEADER_CHAIN, ..) => format!(
                "the batch header chain of segment {} is broken",
                finding.segment.map_or_else(|| "?".to_owned(), |segment| segment.to_string())
            ),
            (kind, ..) => format!("{kind} damage"),
        };
        println!(
            "{:<17}{what}: drive {}, log location {}, found in pass {}{}",
            "scrub finding:",
            finding.drive,
            finding.location,
            finding.pass,
            if finding.repaired { ", repaired" } else { ", not repaired" }
        );
    }
}

/// The backend as `node show` prints it: memory drives are flagged, loudly.
fn drive_backend(backend: &str) -> String {
    match backend {
        "memory" => "memory (NOT DURABLE: every volume is lost when the node stops)".to_owned(),
        other => other.to_owned(),
    }
}

pub fn volume_changed(json: bool, verb: &str, volume: &VolumeInfo) -> anyhow::Result<()> {
    if json {
        return print_json(volume);
    }
    println!("{verb} volume {} ({})", volume.name, ByteSize(volume.size_bytes));
    if verb != "deleted" {
        println!("  connect: {}", volume.nvme_connect_command());
    }
    Ok(())
}

/// What `volume show` adds about this node's replica when its size lags the volume's record
/// (`served_bytes`, 0 from a node that does not say) or it refused writes from the primary.
fn replica_notes(served_bytes: u64, entries_refused: u64, volume_bytes: u64) -> Vec<String> {
    let mut lines = Vec::new();
    if served_bytes != 0 && served_bytes < volume_bytes {
        lines.push(format!(
            "{:<13}this node serves {} of the volume's {}: it grows when it can (see its log); \
             `ferrite volume resize` with the new size waits for it",
            "GROWING:",
            ByteSize(served_bytes),
            ByteSize(volume_bytes),
        ));
    }
    if entries_refused > 0 {
        lines.push(format!(
            "{:<13}{entries_refused} writes from the primary refused: their blocks lay beyond \
             this node's copy of the volume (for a moment after a grow, until this node grew \
             too, and the primary sent them again; otherwise its size here differs from the \
             primary's)",
            "refused:",
        ));
    }
    lines
}

pub fn volume(json: bool, volume: &VolumeInfo) -> anyhow::Result<()> {
    if json {
        return print_json(volume);
    }
    let rows = [
        ("name", volume.name.clone()),
        ("id", volume.id.to_string()),
        ("size", format!("{} ({} bytes)", ByteSize(volume.size_bytes), volume.size_bytes)),
        ("mapped", optional_bytes(volume.mapped_bytes, "")),
        ("used", optional_bytes(volume.physical_used_bytes, " on the drives")),
        ("compression", compression_summary(&volume.compression)),
        (
            "reduction",
            format!("{} (mapped bytes per byte on the drives)", reduction(volume.data_reduction)),
        ),
        ("uuid", volume.uuid.clone()),
        ("created", api::rfc3339_utc(volume.created_unix_ms)),
        ("nqn", volume.nqn.clone()),
        ("address", format!("tcp {}:{}", volume.nvme_host, volume.nvme_port)),
        ("connect", volume.nvme_connect_command()),
        ("access", access_summary(volume.access, &volume.name)),
        ("nbd", nbd_summary(volume.nbd_uri.as_deref(), volume.access)),
        ("origin", volume.origin.clone().unwrap_or_else(|| "none (not a clone)".to_owned())),
        ("snapshots", snapshot_summary(volume.snapshot_count, &volume.name)),
    ];
    for (key, value) in rows {
        println!("{:<13}{value}", format!("{key}:"));
    }
    if let Some(replication) = &volume.replication {
        let list = |names: &[String]| {
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        };
        let away: Vec<String> = replication
            .members
            .iter()
            .filter(|member| !replication.in_sync.contains(member))
            .cloned()
            .collect();
        let rows = [
            ("replicas", format!("{} ({})", replication.members.len(), list(&replication.members))),
            ("primary", replication.primary.clone().unwrap_or_else(|| "none yet".to_owned())),
            ("epoch", replication.epoch.to_string()),
            ("in sync", list(&replication.in_sync)),
            ("resyncing", if away.is_empty() { "none".to_owned() } else { away.join(", ") }),
        ];
        for (key, value) in rows {
            println!("{:<13}{value}", format!("{key}:"));
        }
        // The copies the primary reports, under the list of the replicas not in sync.
        for progress in &replication.resync {
            println!("{}", resync_line(progress));
        }
        if let Some(local) = &replication.local {
            println!(
                "{:<13}{}: {}{}, {} writes completed, {} resyncs done of {} started, {} blocks \
                 resynced, {} blocks pushed after failovers",
                "this node:",
                local.node,
                if local.serving { "serving (primary)" } else { "replica" },
                if local.failed { ", STORAGE FAILED" } else { "" },
                local.writes_completed,
                local.resyncs_completed,
                local.resyncs_started,
                local.blocks_resynced,
                local.blocks_pushed,
            );
            let repair = [
                local.reads_repaired,
                local.reads_unrecovered,
                local.peer_reads_served,
                local.damaged_found,
                local.blocks_sent_for_repair,
                local.reconcile_blocks_repaired,
                local.reconcile_unrecovered,
            ];
            if repair.iter().any(|count| *count > 0) {
                println!(
                    "{:<13}{} reads of damaged blocks served from a replica ({} blocks rewritten \
                     here), {} failed with no good copy in sync, {} served to the primary; \
                     scrub found {} damaged blocks here, {} since rewritten; {} blocks sent to \
                     replicas with damaged copies; after failovers, {} damaged blocks taken from \
                     another member, {} reconciliations stopped with no good copy",
                    "read repair:",
                    local.reads_repaired,
                    local.blocks_repaired,
                    local.reads_unrecovered,
                    local.peer_reads_served,
                    local.damaged_found,
                    local.damaged_rewritten,
                    local.blocks_sent_for_repair,
                    local.reconcile_blocks_repaired,
                    local.reconcile_unrecovered,
                );
            }
            for line in replica_notes(local.size_bytes, local.entries_refused, volume.size_bytes) {
                println!("{line}");
            }
        }
    }
    Ok(())
}

/// One copy to a replica that is not in sync: `resync to node3: 41% (12,288 of 29,952 blocks,
/// incremental)`. The percentage is rounded down, so a copy shows 100% only when it is done.
fn resync_line(progress: &api::ResyncProgress) -> String {
    format!(
        "resync to {}: {}% ({} of {} blocks, {})",
        progress.node,
        progress.percent().floor(),
        thousands(progress.blocks_copied),
        thousands(progress.blocks_total),
        if progress.full { "full copy" } else { "incremental" }
    )
}

/// An amount in MiB to a tenth, rounded (`1,576.3 MiB`): for amounts that move, where
/// `ByteSize`'s exact units would print bytes.
fn mib(bytes: u64) -> String {
    let tenths = (u128::from(bytes) * 10 + (1 << 19)) >> 20;
    format!("{}.{} MiB", thousands(u64::try_from(tenths / 10).unwrap_or(u64::MAX)), tenths % 10)
}

/// A count with thousands separators: `29,952`.
fn thousands(count: u64) -> String {
    bench::group_digits(&count.to_string())
}

pub fn cluster(json: bool, cluster: &api::ClusterInfo) -> anyhow::Result<()> {
    if json {
        return print_json(cluster);
    }
    let live = cluster.nodes.iter().filter(|node| node.live).count();
    println!("cluster:     {}", cluster.name);
    println!("answered by: {}", cluster.node);
    println!("manager:     {}", cluster.manager.clone().unwrap_or_else(|| "none".to_owned()));
    println!("nodes:       {live} live of {}", cluster.nodes.len());
    println!(
        "volumes:     {} ({} degraded: a replica out of sync or its node away)",
        cluster.volumes, cluster.volumes_degraded
    );
    println!();
    node_table(&cluster.nodes);
    Ok(())
}

pub fn node_list(json: bool, cluster: &api::ClusterInfo) -> anyhow::Result<()> {
    if json {
        return print_json(&cluster.nodes);
    }
    node_table(&cluster.nodes);
    Ok(())
}

fn node_table(nodes: &[api::ClusterNode]) {
    println!(
        "{:<16} {:>4} {:<5} {:<22} {:<22} {:>10} {:>10} {:>8} {:>9}  LABELS",
        "NAME", "ID", "STATE", "NVME", "API", "CAPACITY", "FREE", "REPLICAS", "PRIMARIES"
    );
    for node in nodes {
        let labels: Vec<String> =
            node.labels.iter().map(|(key, value)| format!("{key}={value}")).collect();
        println!(
            "{:<16} {:>4} {:<5} {:<22} {:<22} {:>10} {:>10} {:>8} {:>9}  {}",
            node.name,
            node.id,
            if node.live { "up" } else { "DOWN" },
            node.nvme_addrs.first().map_or("-", String::as_str),
            if node.api_addr.is_empty() { "-" } else { node.api_addr.as_str() },
            ByteSize(node.capacity_bytes).to_string(),
            ByteSize(node.free_bytes).to_string(),
            node.replicas,
            node.primaries,
            labels.join(","),
        );
    }
}

fn compression_summary(compression: &str) -> String {
    match compression {
        api::COMPRESSION_OFF => "off (blocks are stored as written)".to_owned(),
        other => format!("{other} (blocks that do not shrink are stored raw)"),
    }
}

/// Where NBD clients find a volume (or a snapshot of it), or why they cannot.
fn nbd_summary(uri: Option<&str>, access: AccessMode) -> String {
    match (uri, access) {
        (Some(uri), _) => uri.to_owned(),
        (None, AccessMode::Restricted) => {
            "not exported: restricted to listed NVMe hosts (NBD clients present none)".to_owned()
        }
        (None, AccessMode::Open) => {
            "not served: this node runs without NBD (--nbd-listen off)".to_owned()
        }
    }
}

fn snapshot_summary(count: u32, volume: &str) -> String {
    match count {
        0 => "none".to_owned(),
        count => format!("{count} (`ferrite snapshot list {volume}`)"),
    }
}

pub fn snapshot_changed(json: bool, verb: &str, snapshot: &SnapshotInfo) -> anyhow::Result<()> {
    if json {
        return print_json(snapshot);
    }
    println!(
        "{verb} snapshot {}@{} ({})",
        snapshot.volume,
        snapshot.name,
        ByteSize(snapshot.size_bytes)
    );
    Ok(())
}

pub fn snapshot(json: bool, snapshot: &SnapshotInfo) -> anyhow::Result<()> {
    if json {
        return print_json(snapshot);
    }
    let rows = [
        ("name", snapshot.name.clone()),
        ("volume", snapshot.volume.clone()),
        ("id", snapshot.id.to_string()),
        ("size", format!("{} ({} bytes)", ByteSize(snapshot.size_bytes), snapshot.size_bytes)),
        ("created", api::rfc3339_utc(snapshot.created_unix_ms)),
        (
            "exclusive",
            format!(
                "{} (what deleting it frees; {} bytes)",
                ByteSize(snapshot.exclusive_bytes),
                snapshot.exclusive_bytes
            ),
        ),
        (
            "clone",
            format!(
                "ferrite volume create NEW --from-snapshot {}@{}",
                snapshot.volume, snapshot.name
            ),
        ),
    ];
    for (key, value) in rows {
        println!("{:<11}{value}", format!("{key}:"));
    }
    if let Some(holders) = &snapshot.holders {
        println!("{:<11}{}", "copies:", snapshot_holders(holders));
    }
    // Read-only ways in, from nodes that report them.
    if let Some(nqn) = &snapshot.nqn {
        println!("{:<11}{nqn} (read-only, for the volume's hosts)", "nqn:");
        let nbd = snapshot.nbd_uri.clone().unwrap_or_else(|| {
            "not exported (the volume is restricted to listed hosts, or the node runs without \
             NBD)"
                .to_owned()
        });
        println!("{:<11}{nbd}", "nbd:");
    }
    Ok(())
}

pub fn snapshot_list(json: bool, volume: &str, snapshots: Vec<SnapshotInfo>) -> anyhow::Result<()> {
    if json {
        return print_json(&api::SnapshotList { snapshots });
    }
    if snapshots.is_empty() {
        println!(
            "volume {volume} has no snapshots; take one with `ferrite snapshot create {volume} NAME`"
        );
        return Ok(());
    }
    let header = ["NAME", "SIZE", "EXCLUSIVE", "ID", "CREATED"].map(str::to_owned);
    let row = |snapshot: &SnapshotInfo| {
        [
            snapshot.name.clone(),
            ByteSize(snapshot.size_bytes).to_string(),
            ByteSize(snapshot.exclusive_bytes).to_string(),
            snapshot.id.to_string(),
            api::rfc3339_utc(snapshot.created_unix_ms),
        ]
    };
    // On a cluster, also which live nodes hold a copy of each.
    if snapshots.iter().any(|snapshot| snapshot.holders.is_some()) {
        let [a, b, c, d, e] = header;
        let header = [a, b, c, d, e, "COPIES ON".to_owned()];
        let rows: Vec<[String; 6]> = snapshots
            .iter()
            .map(|snapshot| {
                let [a, b, c, d, e] = row(snapshot);
                let holders = snapshot.holders.as_deref().unwrap_or_default();
                let copies =
                    if holders.is_empty() { "no live node".to_owned() } else { holders.join(",") };
                [a, b, c, d, e, copies]
            })
            .collect();
        print_table(&header, &rows);
    } else {
        let rows: Vec<[String; 5]> = snapshots.iter().map(row).collect();
        print_table(&header, &rows);
    }
    Ok(())
}

/// The nodes holding a snapshot's copies, for `snapshot show` on a cluster.
fn snapshot_holders(holders: &[String]) -> String {
    match holders {
        [] => "none on a live node: no node can serve it or clone it until one holding a copy \
               returns"
            .to_owned(),
        holders => format!(
            "{} ({} live node{} holding a copy, each serving it read-only)",
            holders.join(", "),
            holders.len(),
            if holders.len() == 1 { "" } else { "s" }
        ),
    }
}

/// A size the node may not have reported (an older node).
fn optional_bytes(bytes: Option<u64>, suffix: &str) -> String {
    match bytes {
        Some(bytes) => format!("{}{suffix} ({bytes} bytes)", ByteSize(bytes)),
        None => "unknown (the node does not report it)".to_owned(),
    }
}

pub fn volume_list(json: bool, volumes: Vec<VolumeInfo>) -> anyhow::Result<()> {
    if json {
        return print_json(&api::VolumeList { volumes });
    }
    if volumes.is_empty() {
        println!("no volumes; create one with `ferrite volume create NAME --size SIZE`");
        return Ok(());
    }
    let header =
        ["NAME", "SIZE", "ID", "COMPRESSION", "REDUCTION", "SNAPSHOTS", "ORIGIN", "CREATED", "NQN"]
            .map(str::to_owned);
    let rows: Vec<[String; 9]> = volumes
        .iter()
        .map(|volume| {
            [
                volume.name.clone(),
                ByteSize(volume.size_bytes).to_string(),
                volume.id.to_string(),
                volume.compression.clone(),
                reduction(volume.data_reduction),
                volume.snapshot_count.to_string(),
                volume.origin.clone().unwrap_or_else(|| "-".to_owned()),
                api::rfc3339_utc(volume.created_unix_ms),
                volume.nqn.clone(),
            ]
        })
        .collect();
    print_table(&header, &rows);
    Ok(())
}

fn access_summary(access: AccessMode, volume: &str) -> String {
    match access {
        AccessMode::Open => "open (any host may connect)".to_owned(),
        AccessMode::Restricted => {
            format!("restricted (only allowed hosts may connect; `ferrite host list {volume}`)")
        }
    }
}

pub fn volume_paths(json: bool, paths: &api::VolumePaths) -> anyhow::Result<()> {
    if json {
        return print_json(paths);
    }
    println!("volume {} ({})", paths.volume, paths.nqn);
    let header = ["PORT".to_owned(), "ADDRESS".to_owned(), "ANA STATE".to_owned()];
    let rows: Vec<[String; 3]> = paths
        .paths
        .iter()
        .map(|path| {
            [path.port_id.to_string(), path.address.clone(), path.ana_state.as_str().to_owned()]
        })
        .collect();
    print_table(&header, &rows);
    Ok(())
}

/// After `ferrite host allow|deny`: what was done, then the volume's access as `list` shows it.
pub fn host_access_changed(
    json: bool,
    verb: &str,
    host: &str,
    access: &HostAccess,
) -> anyhow::Result<()> {
    if json {
        return print_json(access);
    }
    if host == api::ANY_HOST {
        println!("{verb} any host on volume {}", access.volume);
    } else {
        println!("{verb} host {host} on volume {}", access.volume);
    }
    host_access(false, access)
}

pub fn host_access(json: bool, access: &HostAccess) -> anyhow::Result<()> {
    if json {
        return print_json(access);
    }
    let state = match (access.access, access.hosts.len()) {
        (AccessMode::Open, _) => "open: any host may connect".to_owned(),
        (AccessMode::Restricted, 0) => format!(
            "restricted: no host may connect; allow one with `ferrite host allow {} HOSTNQN`",
            access.volume
        ),
        (AccessMode::Restricted, 1) => "restricted: only this host may connect".to_owned(),
        (AccessMode::Restricted, count) => {
            format!("restricted: only these {count} hosts may connect")
        }
    };
    println!("{:<8}{} ({})", "volume:", access.volume, access.nqn);
    println!("{:<8}{state}", "access:");
    for host in &access.hosts {
        println!("  {host}");
    }
    Ok(())
}

fn print_table<const COLUMNS: usize>(header: &[String; COLUMNS], rows: &[[String; COLUMNS]]) {
    let mut widths = header.clone().map(|cell| cell.len());
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    for row in std::iter::once(header).chain(rows) {
        let cells: Vec<String> =
            row.iter().zip(widths).map(|(cell, width)| format!("{cell:<width$}")).collect();
        println!("{}", cells.join("  ").trim_end());
    }
}

fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_behind_the_record_or_refusing_writes_says_so() {
        assert_eq!(replica_notes(96 << 20, 0, 96 << 20), Vec::<String>::new());
        assert_eq!(replica_notes(0, 0, 96 << 20), Vec::<String>::new(), "a node that does not say");
        let growing = replica_notes(64 << 20, 0, 96 << 20);
        assert_eq!(growing.len(), 1, "{growing:?}");
        assert!(growing[0].starts_with("GROWING:     this node serves 64MiB of the volume's 96MiB"));
        let refused = replica_notes(96 << 20, 3, 96 << 20);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].starts_with("refused:     3 writes from the primary refused"));
        assert_eq!(replica_notes(64 << 20, 3, 96 << 20).len(), 2);
    }

    fn progress(
        node: &str,
        full: bool,
        blocks_copied: u64,
        blocks_total: u64,
    ) -> api::ResyncProgress {
        api::ResyncProgress { node: node.to_owned(), full, blocks_total, blocks_copied }
    }

    #[test]
    fn amounts_that_move_print_in_mib_to_a_tenth() {
        assert_eq!(mib(0), "0.0 MiB");
        assert_eq!(mib(34_641_838), "33.0 MiB");
        assert_eq!(mib(1_652_555_776), "1,576.0 MiB");
        assert_eq!(mib((1 << 20) + 55_000), "1.1 MiB", "rounded to the nearest tenth");
        assert_eq!(mib((1 << 20) + 50_000), "1.0 MiB");
        assert_eq!(mib(u64::MAX), "17,592,186,044,416.0 MiB");
    }

    #[test]
    fn a_resync_line_says_to_whom_how_far_and_what_kind_of_copy() {
        let check = |progress: api::ResyncProgress, expect: &str| {
            assert_eq!(resync_line(&progress), expect);
        };
        check(
            progress("node3", false, 12_288, 29_952),
            "resync to node3: 41% (12,288 of 29,952 blocks, incremental)",
        );
        check(
            progress("node2", true, 0, 16_384),
            "resync to node2: 0% (0 of 16,384 blocks, full copy)",
        );
        // Rounded down: not 100% before the last block is sent.
        check(
            progress("a", false, 999, 1_000),
            "resync to a: 99% (999 of 1,000 blocks, incremental)",
        );
        check(progress("a", true, 0, 0), "resync to a: 100% (0 of 0 blocks, full copy)");
    }

    #[test]
    fn counts_are_grouped_by_thousands() {
        for (count, expect) in [
            (0, "0"),
            (999, "999"),
            (1_000, "1,000"),
            (29_952, "29,952"),
            (1_234_567, "1,234,567"),
            (u64::MAX, "18,446,744,073,709,551,615"),
        ] {
            assert_eq!(thousands(count), expect);
        }
    }
}
