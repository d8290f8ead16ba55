//! `ferrite`, the one binary: parses the command line, calls `node` or the REST API through
//! `api::Client`, and prints. Anything that decides lives in those crates, not here.

mod print;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use std::io::{IsTerminal as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use types::ByteSize;

/// mimalloc instead of glibc's malloc: the data path allocates per request (buffers, tasks,
/// replicated blocks), and glibc's bins and consolidation cost more there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ROOT_EXAMPLES: &str = "\
Examples:
  Start a single-node cluster in ./ferrite-data, then make a volume and attach it:
    ferrite up
    ferrite volume create db --size 10G
    ferrite volume show db          # prints the `nvme connect` line to run on a Linux host

  Talk to a node elsewhere:
    ferrite volume list --api http://10.0.0.5:8080
    FERRITE_API=http://10.0.0.5:8080 ferrite volume list";

const UP_EXAMPLES: &str = "\
Examples:
  ferrite up
      4 sparse drive files of 16 GiB in ./ferrite-data, NVMe/TCP on 127.0.0.1:4420,
      NBD on 127.0.0.1:10809, REST API on 127.0.0.1:8080.
  ferrite up --data-dir /var/lib/ferrite --drives 8 --drive-size 100G
  ferrite up --drives 6 --erasure-coding 4+2
      Each stripe of 4 data blocks gets 2 parity blocks, each on its own drive: any 2 drives
      may fail without losing data; 4/6 = 67% of the drive space holds data.
  ferrite up --nvme-listen 0.0.0.0:4420 --api-listen 127.0.0.1:9000
  ferrite up --nbd-listen 0.0.0.0:10809     # or --nbd-listen off
      Every volume open to any host is also an NBD export (nbd://HOST:10809/VOLUME), and each
      of its snapshots a read-only one (nbd://HOST:10809/VOLUME@SNAPSHOT); a volume restricted
      to listed NVMe hosts is not exported over NBD, nor are its snapshots.
  ferrite up --data-dir /var/lib/ferrite --drive /dev/nvme1n1 --drive /dev/nvme2n1
      The two NVMe devices are the node's drives (formatted on the first start: everything on
      them is overwritten); the metadata stays in /var/lib/ferrite.
  ferrite up --drive-backend memory --data-threads 1
      4 drives of 1 GiB in RAM, NOT DURABLE: for measuring the target's own cost (IOPS per
      target core) with no drive in the way, like a target serving from RAM.
  ferrite up --data-dir /srv/ferrite --cluster-etcd http://10.0.0.1:2379 --node-name n1 \\
      --nvme-listen 10.0.0.11:4420 --replication-listen 10.0.0.11:7420 --label zone=a
      A member of the cluster `ferrite` kept in that etcd: volumes created with --replicas N
      live on N nodes, and a failed primary is replaced automatically (`ferrite cluster
      status`). SIGTERM hands the volumes this node serves to another replica first.

Drives are created on the first start in DATA-DIR; later starts reuse them and keep every
volume, so --drives, --drive-size and --erasure-coding matter only the first time. Stop with
Ctrl-C or SIGTERM.

Erasure coding: by default a node with 5 or more drives uses 4+1 and a smaller one keeps one
drive's worth of parity (3+1 on 4 drives, 2+1 on 3, a mirror 1+1 on 2; none on 1). A failed
drive changes nothing for hosts while the parity covers it; `ferrite drive replace INDEX` puts
a new drive in its place and rebuilds it in the background (`ferrite node show` reports it). A
drive file found missing at start is replaced and rebuilt the same way, by itself.

With --drive PATH (repeatable, up to 64), the given block devices or existing regular files
are the drives instead of files in DATA-DIR/drives. On the first start they are formatted: a
device that is mounted or in use, smaller than 64 MiB, or already holding another Ferrite
node's drive is refused. Each drive uses as many bytes as the smallest one holds. Later starts
must pass the same drives again, in any order and under any name (a /dev/loopN or /dev/sdX that
was renumbered is fine): each drive is recognised by its superblock (node and drive index). A
node with parity starts without as many devices as its parity covers (a dead disk): each shows
as failed with no device in `ferrite node show`, its data is served from parity, and `ferrite
drive replace INDEX --path NEW` rebuilds it onto a new device; if the old device comes back at
a later start instead, it is stale and is rebuilt in place. Without parity, or with more
devices missing, the start fails naming them. --drives and --drive-size do not apply.

With --drive-backend memory, nothing is durable: the drives are anonymous memory that goes away
with the process, and the metadata lives in a scratch directory under $TMPDIR (or /tmp) that is
removed when the node stops, so every start begins with no volumes. --data-dir is refused. The
drives together may take at most 75% of the RAM available at start (MemAvailable); they are
sparse, so RAM is used only as volumes are written.";

const VOLUME_EXAMPLES: &str = "\
Examples:
  ferrite volume create db --size 10G
  ferrite volume create logs --size 100G --compression zstd
  ferrite volume list
  ferrite volume show db
  ferrite volume resize db 20G
  ferrite volume set-compression db off
  ferrite volume create db-copy --from-snapshot db@nightly
  ferrite volume rollback db --to nightly
  ferrite volume delete db
  ferrite volume list --json | jq '.volumes[].name'

Sizes take binary units: 512M, 10G, 1T (also MiB, GiB, TiB), or plain bytes.";

const HOST_ABOUT: &str = "\
Control which hosts may connect to a volume.

Every volume is either open or restricted:
  open        any host may connect and sees the volume in its discovery log. Volumes start open.
  restricted  only the allowed hosts may connect or see it; with no host allowed, none may.

  ferrite host allow VOLUME HOSTNQN  allow a host. On an open volume this restricts the volume
                                     to that host, and every connected host is disconnected
                                     (allowed hosts reconnect).
  ferrite host deny VOLUME HOSTNQN   remove a host from the allowed hosts and disconnect it. The
                                     volume stays restricted, even when its last host goes. On
                                     an open volume this is refused: allow the hosts you want
                                     instead.
  ferrite host allow VOLUME any      open the volume to every host (the list is forgotten).
  ferrite host deny VOLUME any       allow no host at all and disconnect every host.
  ferrite host list VOLUME           show whether the volume is open and which hosts it allows.

A host NQN is the name the host connects with; on Linux it is in /etc/nvme/hostnqn (create one
with `nvme gen-hostnqn`). A host that is not allowed is refused at Connect with the status
Connect Invalid Host, and does not see the volume in the discovery log. Changes are kept in the
node's metadata and survive restarts.

Every command talks to a running node's REST API (see --api).";

const HOST_EXAMPLES: &str = "\
Examples:
  ferrite host allow db nqn.2014-08.org.nvmexpress:uuid:4c4c4544-0042-4810-8056-b4c04f4d3732
  ferrite host allow db \"$(ssh app1 cat /etc/nvme/hostnqn)\"
  ferrite host list db
  ferrite host list db --json | jq -r '.hosts[]'
  ferrite host deny db nqn.2014-08.org.nvmexpress:uuid:4c4c4544-0042-4810-8056-b4c04f4d3732
  ferrite host allow db any          # back to open: every host may connect
  ferrite host deny db any           # lock down: no host may connect";

/// How long `volume rollback` waits for its answer: on a cluster, the rewrite of every block
/// changed since the snapshot (the node waits as long for the volume's primary).
const ROLLBACK_TIMEOUT_MS: u64 = 30 * 60 * 1_000;

const SNAPSHOT_ABOUT: &str = "\
Take, list, show and delete snapshots of a volume.

A snapshot is a read-only, point-in-time image of a volume. Taking one is instant, whatever the
volume's size: nothing is copied. The snapshot shares every block with the volume; only blocks
the volume overwrites afterwards take new space, so a snapshot costs what has changed since it
was taken (`exclusive` in `snapshot list`: what deleting it frees). A snapshot taken while hosts
write holds every write completed before it was taken (crash-consistent, like a power cut).

Use a snapshot to:
  - roll the volume back to it: `ferrite volume rollback VOLUME --to SNAP` (the writes made
    since the snapshot are dropped);
  - make a writable copy of it, a clone: `ferrite volume create NEW --from-snapshot VOLUME@SNAP`
    (instant too; the clone shares the snapshot's blocks until it overwrites them);
  - read it, for a backup or a check, without touching the volume: hosts the volume admits
    attach it read-only over NVMe/TCP as nqn.2024-01.io.ferrite:snap:VOLUME:SNAP, and NBD
    clients open the read-only export VOLUME@SNAP while the volume is open to every host
    (`nbdcopy nbd://127.0.0.1:10809/db@nightly db-nightly.img`).

Snapshot names follow the volume name rules and are unique per volume. Deleting a volume deletes
its snapshots; its clones stay intact.

On a cluster, host writes to a replicated volume are held for a moment (about as long as the
writes in flight take) while every copy in sync takes the snapshot at the same point; each of
those nodes then holds and serves a copy. `snapshot list` (COPIES ON) and `snapshot show` name
the live nodes holding one: a replica out of sync when the snapshot was taken, or rebuilt later,
holds none. Clones are placed on those nodes; a rollback is done by the volume's primary,
which must hold one (see `ferrite volume rollback --help`).

Every command talks to a running node's REST API (see --api).";

const SNAPSHOT_EXAMPLES: &str = "\
Examples:
  ferrite snapshot create db before-upgrade
  ferrite snapshot list db
  ferrite snapshot show db before-upgrade
  ferrite volume create db-test --from-snapshot db@before-upgrade
  ferrite volume rollback db --to before-upgrade
  ferrite snapshot delete db before-upgrade";

const DRIVE_ABOUT: &str = "\
Replace a failed drive; the node rebuilds its contents from the other drives.

On a node with erasure coding (`ferrite up --erasure-coding K+M`), up to M failed drives change
nothing for hosts: reads of their blocks are rebuilt from parity and writes go on. Replacing a
drive restores the redundancy: new writes go to the new drive at once, and a background rebuild
(paced by `ferrite up --rebuild-mb-per-s`) restores what the old drive held. `ferrite node
show` reports the drive as rebuilding, with the progress. Replace one drive at a time. A node
without parity refuses: its lost data cannot be rebuilt.

Every command talks to a running node's REST API (see --api).";

const DRIVE_EXAMPLES: &str = "\
Examples:
  ferrite drive replace 2
      The node's drives are files in DATA-DIR/drives: drive 2 gets a new empty file (the old
      one is dropped) and is rebuilt.
  ferrite drive replace 1 --path /dev/nvme3n1
      The node runs on block devices (`ferrite up --drive`): /dev/nvme3n1 becomes drive 1; it
      must not be mounted or in use, and must be at least as large as the node's drives. Pass
      it with --drive instead of the old device on later starts.
  ferrite node show       # the rebuild's progress";

/// Ferrite: block storage served over NVMe/TCP.
#[derive(Parser)]
#[command(name = "ferrite", version, after_long_help = ROOT_EXAMPLES, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node in the foreground: a single node, or a cluster member (--cluster-etcd).
    ///
    /// Runs a node with its metadata in DATA-DIR/meta.redb (in etcd for a cluster member's
    /// volumes) and its drives in DATA-DIR/drives, serving volumes over NVMe/TCP and NBD and
    /// the REST API that `ferrite volume` uses. With --drive-backend memory the drives are in
    /// RAM and NOT DURABLE.
    #[command(after_long_help = UP_EXAMPLES)]
    Up(Box<UpArgs>),
    /// Create, list, show, resize, clone, roll back and delete volumes.
    ///
    /// Every command talks to a running node's REST API (see --api).
    #[command(after_long_help = VOLUME_EXAMPLES)]
    Volume(VolumeArgs),
    /// Control which hosts may connect to a volume.
    #[command(long_about = HOST_ABOUT, after_long_help = HOST_EXAMPLES)]
    Host(HostArgs),
    /// Take, list, show and delete snapshots: instant, read-only point-in-time images.
    #[command(long_about = SNAPSHOT_ABOUT, after_long_help = SNAPSHOT_EXAMPLES)]
    Snapshot(SnapshotArgs),
    /// Show this node (capacity, drives, what it serves), or list the cluster's nodes.
    Node(NodeArgs),
    /// Show the cluster: its nodes, their health and the manager.
    #[command(long_about = CLUSTER_ABOUT, after_long_help = CLUSTER_EXAMPLES)]
    Cluster(ClusterArgs),
    /// Replace a failed drive; the node rebuilds it from the other drives.
    #[command(long_about = DRIVE_ABOUT, after_long_help = DRIVE_EXAMPLES)]
    Drive(DriveArgs),
    /// Measure a volume with the five standard workloads over NVMe/TCP, or the engine alone.
    Bench(Box<bench::BenchArgs>),
}

#[derive(Args)]
struct NodeArgs {
    /// The node's REST API.
    #[arg(long, global = true, value_name = "URL", env = "FERRITE_API", default_value = api::DEFAULT_API_URL)]
    api: String,
    /// Print JSON instead of text, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: NodeCommand,
}

#[derive(Subcommand)]
enum NodeCommand {
    /// Show the node's identity, capacity and listen addresses.
    #[command(after_long_help = "Example:\n  ferrite node show")]
    Show,
    /// List the nodes of the cluster this node belongs to: health, addresses, labels,
    /// capacity and the replicas each holds.
    #[command(after_long_help = "Example:\n  ferrite node list --api http://10.0.0.1:8080")]
    List,
}

const CLUSTER_ABOUT: &str = "Show the cluster: its nodes, their health and the manager.

A cluster is several `ferrite up` nodes that share one etcd (--cluster-etcd) and one
--cluster-name. Volumes created with --replicas N are kept on N distinct nodes: the primary
serves hosts and completes a write only once every in-sync replica has it durably; if the
primary fails, another in-sync replica takes over within a few seconds (its NVMe/TCP path turns
ANA optimized, and hosts' native multipath moves to it). Any node's REST API answers for the
whole cluster.";

const CLUSTER_EXAMPLES: &str = "Examples:
  # three nodes on one machine, sharing a local etcd (etcd --data-dir /tmp/etcd)
  ferrite up --data-dir /srv/n1 --cluster-etcd http://127.0.0.1:2379 --node-name n1 \\
      --api-listen 127.0.0.1:8081 --nvme-listen 127.0.0.1:4431 --replication-listen 127.0.0.1:7431
  (the same for n2 and n3 with their own ports)
  ferrite cluster status --api http://127.0.0.1:8081
  ferrite volume create db --size 10G --replicas 3 --api http://127.0.0.1:8081
  ferrite volume show db --api http://127.0.0.1:8081";

#[derive(Args)]
struct ClusterArgs {
    /// Any node's REST API.
    #[arg(long, global = true, value_name = "URL", env = "FERRITE_API", default_value = api::DEFAULT_API_URL)]
    api: String,
    /// Print JSON instead of text, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: ClusterCommand,
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// The cluster's name, manager, nodes (live or not) and degraded volumes.
    #[command(after_long_help = "Example:\n  ferrite cluster status")]
    Status,
}

#[derive(Args)]
struct DriveArgs {
    /// The node's REST API.
    #[arg(long, global = true, value_name = "URL", env = "FERRITE_API", default_value = api::DEFAULT_API_URL)]
    api: String,
    /// Print JSON instead of text, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: DriveCommand,
}

#[derive(Subcommand)]
enum DriveCommand {
    /// Put a new drive in place of drive INDEX and rebuild it from the other drives.
    ///
    /// For drive files (the default), the node makes a new empty sparse file for the drive;
    /// leave --path out. For block devices or files given with `ferrite up --drive`, give the
    /// new one with --path. The rebuild runs in the background; `ferrite node show` follows it.
    #[command(after_long_help = DRIVE_EXAMPLES)]
    Replace {
        /// The drive's index, as `ferrite node show` lists it (from 0).
        index: u16,
        /// The new block device or file (nodes on `--drive` drives only).
        #[arg(long, value_name = "PATH")]
        path: Option<PathBuf>,
    },
}

#[derive(Args)]
struct SnapshotArgs {
    /// The node's REST API.
    #[arg(long, global = true, value_name = "URL", env = "FERRITE_API", default_value = api::DEFAULT_API_URL)]
    api: String,
    /// Print JSON instead of tables, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: SnapshotCommand,
}

#[derive(Subcommand)]
enum SnapshotCommand {
    /// Take a snapshot of a volume: instant, read-only, sharing the volume's blocks.
    ///
    /// Hosts may keep writing: the snapshot holds every write completed before it was taken,
    /// and for writes in flight either the old or the new data, as after a power cut. To
    /// capture a file system cleanly, freeze it first (`fsfreeze -f MOUNTPOINT`, then `-u`).
    ///
    /// On a cluster the volume's primary holds host writes for a moment (about as long as the
    /// writes in flight take to complete; at most 5 s) until every write it took completed,
    /// and each copy in sync then takes the snapshot:
    /// the same point in time on every node, each of which serves it read-only. A replica out
    /// of sync then gets none. If the primary changes meanwhile the command fails with
    /// snapshot_unavailable, keeps nothing, and may be run again.
    #[command(after_long_help = "Example:\n  ferrite snapshot create db before-upgrade")]
    Create {
        /// The volume to snapshot.
        volume: String,
        /// The snapshot's name: the volume name rules, unique among the volume's snapshots.
        snapshot: String,
    },
    /// List a volume's snapshots, oldest first, with what deleting each would free.
    #[command(
        after_long_help = "Examples:\n  ferrite snapshot list db\n  ferrite snapshot list db --json"
    )]
    List { volume: String },
    /// Show one snapshot.
    #[command(after_long_help = "Example:\n  ferrite snapshot show db before-upgrade")]
    Show { volume: String, snapshot: String },
    /// Delete a snapshot. The space only it holds is freed in the background.
    ///
    /// The volume and clones made from the snapshot are not affected: clones keep the blocks
    /// they read.
    #[command(after_long_help = "Example:\n  ferrite snapshot delete db before-upgrade")]
    Delete { volume: String, snapshot: String },
}

#[derive(Args)]
struct HostArgs {
    /// The node's REST API.
    #[arg(long, global = true, value_name = "URL", env = "FERRITE_API", default_value = api::DEFAULT_API_URL)]
    api: String,
    /// Print JSON instead of text, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: HostCommand,
}

#[derive(Subcommand)]
enum HostCommand {
    /// Allow a host to connect to a volume, or `any` host.
    ///
    /// The first host allowed on an open volume restricts it to the allowed hosts and
    /// disconnects every connected host (allowed hosts reconnect). `any` opens the volume to
    /// every host and forgets the list.
    #[command(
        after_long_help = "Examples:\n  ferrite host allow db nqn.2014-08.org.nvmexpress:uuid:4c4c4544-0042-4810-8056-b4c04f4d3732\n  ferrite host allow db any"
    )]
    Allow {
        volume: String,
        /// The host's NQN (on Linux, from /etc/nvme/hostnqn), or `any`.
        #[arg(value_name = "HOSTNQN|any")]
        host: String,
    },
    /// Deny a host access to a volume, or `any` host; denied hosts are disconnected.
    ///
    /// The volume stays restricted even when its last allowed host is denied: it never opens to
    /// every host by itself. `any` allows no host at all. A single host cannot be denied while
    /// the volume is open to any host: allow the hosts that may connect instead.
    #[command(
        after_long_help = "Examples:\n  ferrite host deny db nqn.2014-08.org.nvmexpress:uuid:4c4c4544-0042-4810-8056-b4c04f4d3732\n  ferrite host deny db any"
    )]
    Deny {
        volume: String,
        /// The host's NQN, or `any`.
        #[arg(value_name = "HOSTNQN|any")]
        host: String,
    },
    /// Show whether a volume is open to any host, and which hosts it allows.
    #[command(
        after_long_help = "Examples:\n  ferrite host list db\n  ferrite host list db --json"
    )]
    List { volume: String },
}

#[derive(Args)]
struct UpArgs {
    /// Where the node keeps its metadata and drives [default: ferrite-data]. Not with
    /// --drive-backend memory.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// What holds the drives: `file` (sparse files in DATA-DIR/drives, durable) or `memory`
    /// (RAM: NOT DURABLE, every volume is lost when the node stops; for benchmarking).
    #[arg(long, value_name = "BACKEND", value_enum, default_value_t = DriveBackendArg::File)]
    drive_backend: DriveBackendArg,
    /// Drives to create on the first start [default: 4].
    #[arg(long, value_name = "N", conflicts_with = "drive")]
    drives: Option<u16>,
    /// Size of each drive (sparse) on the first start, such as 16G [default: 16GiB; 1GiB with
    /// --drive-backend memory].
    #[arg(long, value_name = "SIZE", conflicts_with = "drive")]
    drive_size: Option<ByteSize>,
    /// A block device (or an existing file) to use as a drive instead of files in
    /// DATA-DIR/drives; give it once per drive. Formatted on the first start; later starts
    /// must pass the same drives, in any order.
    #[arg(long, value_name = "PATH")]
    drive: Vec<PathBuf>,
    /// On the first start, write zeros over each drive file once (about a second per GiB), so
    /// the filesystem allocates every block up front. Without it the files start sparse, and
    /// the node lays out the few free segments its log takes next in the background (zeros
    /// written over their holes, `ferrite_laid_out_bytes_total`), so the log's durable writes
    /// do not pay the filesystem's allocation and its metadata update; this option does it all
    /// before serving instead, at the cost of the time and the disk space. Drive files only:
    /// block devices need no lay-out.
    #[arg(long, conflicts_with = "drive")]
    lay_out_drives: bool,
    /// Address to serve NVMe/TCP on; give it several times for several paths (NVMe ports 1, 2,
    /// ... in that order) that hosts' multipath can use [default: 127.0.0.1:4420].
    #[arg(long, value_name = "ADDR")]
    nvme_listen: Vec<SocketAddr>,
    /// Address to serve NBD on: every volume open to any host is also an NBD export named
    /// after it (`nbd://127.0.0.1:10809/NAME`); `off` serves no NBD.
    #[arg(long, value_name = "ADDR|off", default_value = "127.0.0.1:10809")]
    nbd_listen: ListenOrOff,
    /// Address to serve the REST API on.
    #[arg(long, value_name = "ADDR", default_value_t = node::config::DEFAULT_API_LISTEN)]
    api_listen: SocketAddr,
    /// Data-path threads serving NVMe/TCP and NBD (one runtime and io_uring ring each)
    /// [default: one per CPU; one on a cluster node].
    ///
    /// On a cluster node (--cluster-etcd) every volume's I/O goes through the replication
    /// service, which runs on the first data-path thread, so a host connection served on
    /// another thread hands each command across threads and back; one thread spent less CPU
    /// per I/O in the measurements (docs/BENCHMARKS.md). More threads spread the nodes' reads
    /// and protocol work over more cores, at that price.
    #[arg(long, value_name = "N", default_value_t = 0, hide_default_value = true)]
    data_threads: usize,
    /// Busy-poll each data-path thread for this many microseconds after the last bytes it
    /// received before letting it sleep; 0 never polls.
    ///
    /// Polling keeps a data-path thread's CPU awake while I/O flows, so the next command does
    /// not wait for the CPU to wake up: on virtual machines a sleeping vCPU takes tens to
    /// hundreds of microseconds to wake. It costs a busy core per data-path thread while hosts
    /// send I/O (none while idle). Worth it on a storage server with cores to spare; leave it
    /// off when the node shares its cores with the applications using it. Example: --poll-us 200.
    #[arg(long, value_name = "US", default_value_t = 0)]
    poll_us: u64,
    /// Rewrite scattered blocks that hosts read together: on or off.
    ///
    /// A read of several blocks that lie scattered over the log (each written on its own, by
    /// random small writes) has them written again back to back in the background, so the next
    /// read of that range is one drive read instead of one per block. The rewrite reuses the
    /// data just read, never overrides a newer write, pauses while free space is below the
    /// point where GC works (GC behind the writes), and counts in the write amplification
    /// (`ferrite node show`, `ferrite_defrag_relocated_blocks_total`). It pays where the drives
    /// are the bottleneck, on a single node and on cluster nodes alike (docs/BENCHMARKS.md);
    /// where the CPU is, the rewrite costs more than it saves. Turn it off to keep reads from
    /// ever causing writes, for example on media with little write endurance. `auto`, once off
    /// on cluster nodes, is accepted and now means on.
    #[arg(long, value_name = "on|off", default_value = "on")]
    read_defrag: ReadDefragArg,
    /// The most the background scrub reads per second, in MiB; 0 turns it off.
    ///
    /// The scrub reads every live block back and checks it against its checksum, so damage on
    /// a drive is found before a host reads it; `ferrite node show` reports its passes and what
    /// it found. It only reads and never holds up host writes, but its reads share the drives,
    /// so it yields to hosts: while they read and write through the node at 1 MiB/s or more,
    /// it reads at a sixteenth of this rate (at least 1 MiB/s, so a pass still ends under
    /// steady load), and at the full rate again once they have been quiet for a second. Raise
    /// the rate on fast drives, lower it where host I/O needs every bit of bandwidth. A pass
    /// starts at most once a minute. It pauses while a drive is latched failed.
    #[arg(long, value_name = "MB", default_value_t = node::scrub::DEFAULT_SCRUB_MB_PER_S)]
    scrub_mb_per_s: u64,
    /// Erasure coding across the drives, on the first start: K+M (such as 4+1) or none
    /// [default: 4+1 with 5 or more drives, else one parity drive and the rest data: 3+1 on 4,
    /// 2+1 on 3, a mirror 1+1 on 2; none on 1].
    ///
    /// Each stripe of K data blocks gets M parity blocks, each of the K+M blocks on its own
    /// drive. What survives: any M drives may fail without losing data or stopping I/O (reads
    /// of a failed drive's blocks are rebuilt from the others, and a replaced drive is rebuilt
    /// in the background, see `ferrite drive replace`). The cost: K/(K+M) of the raw drive
    /// space holds data (4+1: 80%, 2+1: 67%, 4+2: 67%, 1+1: 50%), and writes also write the
    /// parity. `none` keeps all the space for data and survives no drive loss: a failed drive
    /// fails the node's writes and the reads of its blocks. K+M may not exceed the drives (a
    /// wider request falls back to fewer data blocks, as the log says); M is at most 3. Fixed
    /// at the first start: later starts keep it and refuse another.
    #[arg(long, value_name = "K+M|none", value_parser = parse_erasure_coding)]
    erasure_coding: Option<node::ErasureScheme>,
    /// The most a drive rebuild writes per second, in MiB; 0 sets no limit.
    ///
    /// After `ferrite drive replace` (or a drive file found missing at start) the node rebuilds
    /// the new drive from the others in the background, yielding to host I/O between steps.
    /// Until it finishes, the stripes it has not restored have one parity block less: a faster
    /// rebuild restores redundancy sooner, a slower one leaves hosts more of the drives. While
    /// hosts read and write through the node at 1 MiB/s or more it writes at a quarter of this
    /// rate (at least 16 MiB/s, so redundancy still comes back under steady load), and at the
    /// full rate again once they have been quiet for a second.
    #[arg(long, value_name = "MB", default_value_t = node::rebuild::DEFAULT_REBUILD_MB_PER_S)]
    rebuild_mb_per_s: u64,
    /// Join a cluster whose state is kept in this etcd (comma-separated endpoints such as
    /// http://10.0.0.1:2379).
    ///
    /// Without it the node is a single node with its metadata in DATA-DIR/meta.redb. With it,
    /// volumes live in etcd and are replicated across the cluster's nodes (`ferrite volume
    /// create --replicas N`); the node needs --node-name. Snapshots of a replicated volume are
    /// taken on every copy in sync at one point in time, and clones of them are replicated too;
    /// rolling a volume back is a single-node feature for now.
    #[arg(long, value_name = "URLS", value_delimiter = ',', help_heading = "Cluster")]
    cluster_etcd: Vec<String>,
    /// The cluster's name; nodes with the same etcd and name form one cluster.
    #[arg(long, value_name = "NAME", default_value = node::cluster::DEFAULT_CLUSTER_NAME, help_heading = "Cluster")]
    cluster_name: String,
    /// This node's name in the cluster, unique (1 to 64 of A-Z a-z 0-9 . _ -) [default: the
    /// host name].
    #[arg(long, value_name = "NAME", help_heading = "Cluster")]
    node_name: Option<String>,
    /// Where this node takes replication traffic from the other nodes.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7420", help_heading = "Cluster")]
    replication_listen: SocketAddr,
    /// A placement label KEY=VALUE (repeatable). Replicas go to nodes with distinct `zone`
    /// labels while there are enough zones.
    #[arg(long, value_name = "KEY=VALUE", help_heading = "Cluster")]
    label: Vec<String>,
    /// How long a silent node keeps its lease, in ms (whole seconds, at least 2000): a
    /// crashed primary is replaced about this long after it stopped.
    #[arg(long, value_name = "MS", default_value_t = node::cluster::DEFAULT_LEASE_MS, help_heading = "Cluster")]
    lease_ms: u64,
    /// How long a node may be away before its replicas are rebuilt on other nodes, in
    /// seconds. A node back sooner only copies what changed while it was away.
    #[arg(long, value_name = "S", default_value_t = node::cluster::DEFAULT_REBUILD_GRACE_S, help_heading = "Cluster")]
    rebuild_grace_s: u64,
    /// The most resync and rebuild copy to other nodes per second, in MiB.
    #[arg(long, value_name = "MB", default_value_t = node::cluster::DEFAULT_RESYNC_MB_PER_S, help_heading = "Cluster")]
    resync_mb_per_s: u64,
    /// How long a starting node waits for etcd to answer, in seconds, trying again every
    /// second (say, the node and etcd started together, or etcd restarting); 0 gives up at
    /// the first refusal. The node serves nothing until it has joined.
    #[arg(long, value_name = "S", default_value_t = node::cluster::DEFAULT_ETCD_WAIT_S, help_heading = "Cluster")]
    etcd_wait_s: u64,
    /// How long this node keeps data that no record names before dropping it, in seconds (at
    /// least 10): its copy of a snapshot deleted while it could not be told (down, paused, cut
    /// off), or of one whose taking failed. A snapshot's copies have no record until every
    /// copy is taken, so keep it well above how long that may take (seconds).
    #[arg(long, value_name = "S", default_value_t = node::cluster::DEFAULT_UNNAMED_DATA_GRACE_S, help_heading = "Cluster")]
    unnamed_data_grace_s: u64,
}

/// `--cluster-*` options as the node takes them; `None` without --cluster-etcd.
fn cluster_config(args: &UpArgs) -> anyhow::Result<Option<node::cluster::ClusterConfig>> {
    if args.cluster_etcd.is_empty() {
        return Ok(None);
    }
    let node_name = match &args.node_name {
        Some(name) => name.clone(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("read the host name for --node-name")?
            .trim()
            .to_owned(),
    };
    let mut labels = std::collections::BTreeMap::new();
    for label in &args.label {
        let Some((key, value)) = label.split_once('=') else {
            anyhow::bail!("--label {label:?} is not KEY=VALUE (for example zone=a)");
        };
        labels.insert(key.to_owned(), value.to_owned());
    }
    let config = node::cluster::ClusterConfig {
        etcd_endpoints: args.cluster_etcd.clone(),
        name: args.cluster_name.clone(),
        node_name,
        replication_listen: args.replication_listen,
        labels,
        lease_ms: args.lease_ms,
        rebuild_grace_s: args.rebuild_grace_s,
        resync_mb_per_s: args.resync_mb_per_s,
        etcd_wait_s: args.etcd_wait_s,
        unnamed_data_grace_s: args.unnamed_data_grace_s,
    };
    config.validate().map_err(anyhow::Error::msg)?;
    Ok(Some(config))
}

fn parse_erasure_coding(text: &str) -> Result<node::ErasureScheme, String> {
    node::config::parse_erasure_coding(text).map_err(|error| error.to_string())
}

/// A listen address, or `off`.
#[derive(Debug, Clone, Copy)]
struct ListenOrOff(Option<SocketAddr>);

impl std::str::FromStr for ListenOrOff {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "off" {
            return Ok(Self(None));
        }
        text.parse().map(|addr| Self(Some(addr))).map_err(|_| {
            format!("{text:?} is neither an address such as 127.0.0.1:10809 nor `off`")
        })
    }
}

/// `--read-defrag`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ReadDefragArg {
    #[value(alias = "auto")]
    On,
    Off,
}

/// `--drive-backend`: the CLI's names of `node::DriveBackend`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DriveBackendArg {
    /// Sparse drive files in DATA-DIR/drives, written with O_DIRECT: durable.
    File,
    /// Drives in RAM: NOT DURABLE, everything is lost when the node stops.
    Memory,
}

#[derive(Args)]
struct VolumeArgs {
    /// The node's REST API.
    #[arg(long, global = true, value_name = "URL", env = "FERRITE_API", default_value = api::DEFAULT_API_URL)]
    api: String,
    /// Print JSON instead of tables, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: VolumeCommand,
}

#[derive(Subcommand)]
enum VolumeCommand {
    /// Create a volume.
    ///
    /// Hosts find it as the NVMe subsystem nqn.2024-01.io.ferrite:vol:NAME; `ferrite volume
    /// show NAME` prints the `nvme connect` line.
    ///
    /// With --from-snapshot VOLUME@SNAP the new volume is a clone: a writable copy of the
    /// snapshot, made instantly. It shares the snapshot's blocks until it overwrites them, so it
    /// takes space only for what it changes. It is independent of its source: deleting the
    /// snapshot or its volume later leaves the clone intact. Its size is the snapshot's, or
    /// --size if larger (the added space reads zeros).
    #[command(
        after_long_help = "Examples:\n  ferrite volume create db --size 10G\n  ferrite volume \
                           create db-test --from-snapshot db@before-upgrade\n  ferrite volume \
                           create db-big --from-snapshot db@before-upgrade --size 20G"
    )]
    Create {
        /// 1 to 63 characters from a-z, 0-9, '-' and '_', starting with a letter or digit.
        name: String,
        /// A multiple of 4 KiB from 1 MiB to 1 PiB, such as 10G or 512M. Required unless
        /// --from-snapshot is given.
        #[arg(long, value_name = "SIZE", required_unless_present = "from_snapshot")]
        size: Option<ByteSize>,
        /// Make the volume a clone of this snapshot, written VOLUME@SNAP.
        #[arg(long, value_name = "VOLUME@SNAP")]
        from_snapshot: Option<String>,
        /// How the volume's blocks are stored: lz4 (the default), zstd or off.
        ///
        /// Compression is transparent to hosts and saves drive space on data that compresses
        /// (text, logs, databases with sparse pages). lz4 costs little CPU per write and read;
        /// zstd usually saves more space for more CPU; off stores every block as written. A
        /// block that does not shrink (already compressed or encrypted data) is stored raw
        /// whatever the setting, so incompressible data costs no extra space. A clone uses its
        /// source volume's setting unless this is given. `volume show` reports the data
        /// reduction achieved.
        #[arg(long, value_name = "lz4|zstd|off")]
        compression: Option<String>,
        /// Copies of the volume on distinct nodes of the cluster, 1 to 3.
        ///
        /// Every write completes only once all in-sync copies have it durably; the volume
        /// survives the loss of N-1 nodes, and a failed primary is replaced automatically.
        /// Needs a cluster (`ferrite up --cluster-etcd`); a single node takes only 1. A clone's
        /// copies go to nodes that hold a copy of its snapshot (those in sync when it was
        /// taken), so it has at most as many.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=3))]
        replicas: Option<u8>,
    },
    /// Change how a volume's new writes are stored: lz4, zstd or off.
    ///
    /// Blocks already written keep their form (they are not rewritten); the new setting applies
    /// to every write from now on, and survives restarts.
    #[command(after_long_help = "Example:\n  ferrite volume set-compression db zstd")]
    SetCompression {
        name: String,
        #[arg(value_name = "lz4|zstd|off")]
        compression: String,
    },
    /// Roll a volume back to one of its snapshots, dropping every write made since.
    ///
    /// The volume then reads exactly what the snapshot holds; the snapshot itself stays (roll
    /// back to it again, or delete it). Writes made after the snapshot are lost for good:
    /// take another snapshot first if you may want them back. Hosts should stop using the
    /// volume first (unmount it): I/O is paused during the rollback, and a host's cache would
    /// still hold the dropped data.
    ///
    /// On a cluster, the volume's primary rewrites every block written since the snapshot
    /// with the snapshot's data, through replication, so every copy in sync reads as the
    /// snapshot: this takes as long as writing what changed, I/O is not paused (stop the
    /// hosts' writes first), and a rollback interrupted half way leaves some blocks rolled
    /// back and others not (run it again to finish). The primary needs a copy of the
    /// snapshot (`ferrite snapshot show` names the nodes holding one).
    #[command(after_long_help = "Example:\n  ferrite volume rollback db --to before-upgrade")]
    Rollback {
        name: String,
        /// The snapshot of this volume to roll back to.
        #[arg(long, value_name = "SNAP")]
        to: String,
    },
    /// List every volume.
    #[command(after_long_help = "Examples:\n  ferrite volume list\n  ferrite volume list --json")]
    List,
    /// Show a volume and how a host attaches it.
    #[command(after_long_help = "Example:\n  ferrite volume show db")]
    Show { name: String },
    /// Delete a volume and its data.
    ///
    /// Hosts still connected lose the volume; disconnect them first.
    #[command(after_long_help = "Example:\n  ferrite volume delete db")]
    Delete { name: String },
    /// Grow a volume to a new size; volumes never shrink.
    ///
    /// Connected hosts may need `nvme ns-rescan` to see the new size; NBD clients see it when
    /// they connect again. On a cluster, every node holding a replica grows its copy, and the
    /// command returns once they all serve the new size (each needs the growth free on its
    /// drives); if one has not within 15 s it says which, and running it again waits again.
    #[command(after_long_help = "Example:\n  ferrite volume resize db 20G")]
    Resize {
        name: String,
        /// The new size, larger than the current one, such as 20G.
        size: ByteSize,
    },
    /// List the volume's NVMe/TCP paths (one per `ferrite up --nvme-listen` address) and their
    /// ANA states.
    #[command(after_long_help = "Example:\n  ferrite volume paths db")]
    Paths { name: String },
    /// Set the volume's ANA state on one path, so hosts' multipath moves I/O.
    ///
    /// Hosts connected through that path get an ANA change notice: Linux native multipath sends
    /// I/O to an optimized path, to a non-optimized one only if none is optimized, and never to
    /// an inaccessible one. Use it to drain a path before maintenance. The state is kept in the
    /// volume's record: a restarted node serves the port in it until it is set optimized again
    /// (if the node restarts with fewer `--nvme-listen` addresses, a missing port's state waits
    /// for the port to return, or is cleared by setting it optimized). Refused on a cluster
    /// node, whose control plane sets the states.
    #[command(after_long_help = "Examples:\n  ferrite volume set-path db --port 2 --state \
                                 inaccessible\n  ferrite volume set-path db --port \
                                 127.0.0.1:4421 --state optimized")]
    SetPath {
        name: String,
        /// The path: its NVMe port ID (1, 2, ... as `volume paths` lists) or its address.
        #[arg(long, value_name = "PORT")]
        port: String,
        /// optimized, non-optimized or inaccessible.
        #[arg(long, value_name = "STATE", value_parser = parse_ana_state)]
        state: api::AnaState,
    },
}

fn parse_ana_state(text: &str) -> Result<api::AnaState, String> {
    api::AnaState::SETTABLE.into_iter().find(|state| state.as_str() == text).ok_or_else(|| {
        format!("{text:?} is not a state to set; give optimized, non-optimized or inaccessible")
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Up(args) => up(*args),
        Command::Volume(args) => volume(args),
        Command::Host(args) => host_command(args),
        Command::Snapshot(args) => snapshot_command(args),
        Command::Node(args) => node_command(args),
        Command::Cluster(args) => cluster_command(args),
        Command::Drive(args) => drive_command(args),
        Command::Bench(args) => bench_command(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", error_chain(&error));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes joined by ": ", leaving out a cause whose text the message before
/// it already holds (many errors name their source in their own message).
fn error_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

fn up(args: UpArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let backend = match args.drive_backend {
        DriveBackendArg::File => node::DriveBackend::File,
        DriveBackendArg::Memory => node::DriveBackend::Memory,
    };
    if backend == node::DriveBackend::Memory && args.data_dir.is_some() {
        anyhow::bail!(
            "--data-dir cannot be used with --drive-backend memory: memory drives are not \
             durable, and their metadata lives in a scratch directory removed when the node \
             stops; drop --data-dir, or use --drive-backend file to keep data"
        );
    }
    let cluster = cluster_config(&args)?;
    let config = node::NodeConfig {
        data_dir: args.data_dir.unwrap_or_else(|| PathBuf::from(node::config::DEFAULT_DATA_DIR)),
        drive_count: args.drives,
        drive_size_bytes: args.drive_size.map(ByteSize::bytes),
        drives: args.drive,
        lay_out_drives: args.lay_out_drives,
        nvme_listen: if args.nvme_listen.is_empty() {
            vec![node::config::DEFAULT_NVME_LISTEN]
        } else {
            args.nvme_listen
        },
        nbd_listen: args.nbd_listen.0,
        api_listen: args.api_listen,
        stop_on_signals: true,
        data_threads: args.data_threads,
        poll_us: args.poll_us,
        read_defrag: match args.read_defrag {
            ReadDefragArg::On => Some(true),
            ReadDefragArg::Off => Some(false),
        },
        scrub_mb_per_s: args.scrub_mb_per_s,
        erasure_coding: args.erasure_coding,
        rebuild_mb_per_s: args.rebuild_mb_per_s,
        cluster,
    };
    let node = node::Node::start_on(config, backend)?;
    print::started(&node);
    std::io::stdout().flush().context("write to stdout")?;
    node.wait_for_stop();
    node.stop()?;
    println!("stopped cleanly");
    Ok(())
}

fn volume(args: VolumeArgs) -> anyhow::Result<()> {
    let client = api::Client::new(&args.api)?;
    let json = args.json;
    match args.command {
        VolumeCommand::Create { name, size, from_snapshot, compression, replicas } => {
            let request = match (from_snapshot, size) {
                (Some(from), size) => {
                    let Some((volume, snapshot)) = api::parse_snapshot_ref(&from) else {
                        anyhow::bail!(
                            "--from-snapshot {from:?} is not VOLUME@SNAP: write the volume, @, \
                             and its snapshot's name, for example db@nightly"
                        );
                    };
                    let mut request = api::CreateVolume::clone_of_snapshot(name, volume, snapshot);
                    request.size_bytes = size.map(ByteSize::bytes);
                    request
                }
                (None, Some(size)) => api::CreateVolume::empty(name, size.bytes()),
                (None, None) => anyhow::bail!("give --size SIZE, or --from-snapshot VOLUME@SNAP"),
            };
            let request = match compression {
                Some(compression) => request.with_compression(compression),
                None => request,
            };
            let request = match replicas {
                Some(replicas) => request.with_replicas(replicas),
                None => request,
            };
            let volume = client.create_volume(&request)?;
            print::volume_changed(json, "created", &volume)
        }
        VolumeCommand::Rollback { name, to } => {
            // On a cluster the answer comes once every changed block is rewritten.
            let client = api::Client::with_timeout_ms(&args.api, ROLLBACK_TIMEOUT_MS)?;
            let volume = client.rollback_volume(&name, &to)?;
            if !json {
                println!("rolled volume {name} back to snapshot {to}");
            }
            print::volume_changed(json, "rolled back", &volume)
        }
        VolumeCommand::List => {
            let volumes = client.list_volumes()?;
            print::volume_list(json, volumes)
        }
        VolumeCommand::Show { name } => print::volume(json, &client.volume(&name)?),
        VolumeCommand::Delete { name } => {
            let volume = client.delete_volume(&name)?;
            print::volume_changed(json, "deleted", &volume)
        }
        VolumeCommand::Resize { name, size } => {
            let volume = client.resize_volume(&name, size.bytes())?;
            print::volume_changed(json, "resized", &volume)
        }
        VolumeCommand::SetCompression { name, compression } => {
            let volume = client.set_compression(&name, &compression)?;
            if !json {
                println!(
                    "volume {name}: new writes are stored with compression {} (blocks already \
                     written keep their form)",
                    volume.compression
                );
            }
            print::volume(json, &volume)
        }
        VolumeCommand::Paths { name } => print::volume_paths(json, &client.volume_paths(&name)?),
        VolumeCommand::SetPath { name, port, state } => {
            let port_id = match port.parse::<u16>() {
                Ok(port_id) => port_id,
                Err(_) => {
                    let paths = client.volume_paths(&name)?;
                    let found = paths.paths.iter().find(|path| path.address == port);
                    let Some(path) = found else {
                        let known: Vec<&str> =
                            paths.paths.iter().map(|path| path.address.as_str()).collect();
                        anyhow::bail!(
                            "volume {name} has no path at {port}; its paths are {}",
                            known.join(", ")
                        );
                    };
                    path.port_id
                }
            };
            let paths = client.set_path_state(&name, port_id, state)?;
            if !json {
                println!("volume {name}: port {port_id} is now {}", state.as_str());
            }
            print::volume_paths(json, &paths)
        }
    }
}

fn snapshot_command(args: SnapshotArgs) -> anyhow::Result<()> {
    let client = api::Client::new(&args.api)?;
    let json = args.json;
    match args.command {
        SnapshotCommand::Create { volume, snapshot } => {
            let info = client.create_snapshot(&volume, &snapshot)?;
            print::snapshot_changed(json, "took", &info)
        }
        SnapshotCommand::List { volume } => {
            print::snapshot_list(json, &volume, client.list_snapshots(&volume)?)
        }
        SnapshotCommand::Show { volume, snapshot } => {
            print::snapshot(json, &client.snapshot(&volume, &snapshot)?)
        }
        SnapshotCommand::Delete { volume, snapshot } => {
            let info = client.delete_snapshot(&volume, &snapshot)?;
            print::snapshot_changed(json, "deleted", &info)
        }
    }
}

fn host_command(args: HostArgs) -> anyhow::Result<()> {
    let client = api::Client::new(&args.api)?;
    let json = args.json;
    match args.command {
        HostCommand::Allow { volume, host } => {
            let access = client.allow_host(&volume, &host)?;
            print::host_access_changed(json, "allowed", &host, &access)
        }
        HostCommand::Deny { volume, host } => {
            let access = client.deny_host(&volume, &host)?;
            print::host_access_changed(json, "denied", &host, &access)
        }
        HostCommand::List { volume } => print::host_access(json, &client.host_access(&volume)?),
    }
}

fn node_command(args: NodeArgs) -> anyhow::Result<()> {
    let client = api::Client::new(&args.api)?;
    match args.command {
        NodeCommand::Show => print::node(args.json, &client.node()?),
        NodeCommand::List => print::node_list(args.json, &client.cluster()?),
    }
}

fn cluster_command(args: ClusterArgs) -> anyhow::Result<()> {
    let client = api::Client::new(&args.api)?;
    match args.command {
        ClusterCommand::Status => print::cluster(args.json, &client.cluster()?),
    }
}

fn drive_command(args: DriveArgs) -> anyhow::Result<()> {
    let client = api::Client::new(&args.api)?;
    match args.command {
        DriveCommand::Replace { index, path } => {
            let path = match path {
                Some(path) => Some(
                    path.to_str()
                        .with_context(|| format!("--path {} is not UTF-8", path.display()))?
                        .to_owned(),
                ),
                None => None,
            };
            let drive = client.replace_drive(index, path.as_deref())?;
            print::drive_replaced(args.json, &drive)
        }
    }
}

fn bench_command(args: &bench::BenchArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the benchmark's runtime")?;
    if let Some(setup) = args.engine_setup()? {
        let local = tokio::task::LocalSet::new();
        return local.block_on(&runtime, async {
            let engine = bench::local::EngineBench::start(&setup).await?;
            eprintln!("engine: {} drive files in {}", setup.drive_count, engine.dir().display());
            // Ctrl-C or SIGTERM ends the run early; dropping the bench then removes its
            // directory, which holds gigabytes of drive files.
            use tokio::signal::unix::{signal, SignalKind};
            let mut interrupt = signal(SignalKind::interrupt()).context("watch for SIGINT")?;
            let mut terminate = signal(SignalKind::terminate()).context("watch for SIGTERM")?;
            let mut connector = engine.connector();
            let result = tokio::select! {
                result = bench::run_command(args, &mut connector) => {
                    result.map(|_| ()).map_err(anyhow::Error::from)
                }
                _ = interrupt.recv() => Err(anyhow::anyhow!("interrupted (SIGINT)")),
                _ = terminate.recv() => Err(anyhow::anyhow!("stopped (SIGTERM)")),
            };
            eprintln!("{}", engine.summary());
            if result.is_err() {
                eprintln!("engine: removing {}", engine.dir().display());
            }
            drop(connector);
            drop(engine);
            result
        });
    }
    let target = args.nvme_tcp_target()?.clone();
    let mut connector = bench::nvme::nvme_connector(&target);
    runtime.block_on(bench::run_command(args, &mut connector))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    /// An error whose message names its source, as many of ours do.
    #[derive(Debug)]
    struct NamesItsSource(std::io::Error);

    impl std::fmt::Display for NamesItsSource {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot lay out drive-001.img: {}", self.0)
        }
    }

    impl std::error::Error for NamesItsSource {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_named_by_its_error_is_not_repeated() {
        let io = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let error =
            anyhow::Error::from(NamesItsSource(io)).context("cannot set up the drive files");
        let text = error_chain(&error);
        assert_eq!(text.matches("No space left on device").count(), 1, "{text}");
        assert!(text.starts_with("cannot set up the drive files: cannot lay out"), "{text}");
        let plain = anyhow::anyhow!("the root cause").context("the outer step");
        assert_eq!(error_chain(&plain), "the outer step: the root cause");
    }
}
