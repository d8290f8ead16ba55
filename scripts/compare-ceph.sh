#!/usr/bin/env bash
# `make compare-ceph`: Ferrite beside Ceph Pacific on this machine, same disk, same fio jobs, same
# pgbench, and the results written into docs/BENCHMARKS.md with a chart (issue 7). The sides run
# one after the other, never at the same time, so neither takes CPU or disk from the other and
# the host disk only ever holds one of them. Everything it starts is stopped on exit, also on
# failure or Ctrl-C. See --help.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

usage() {
    cat <<'EOF'
Usage: scripts/compare-ceph.sh [-h|--help]        (or: make compare-ceph)

Measures Ferrite and Ceph Pacific side by side on this machine and writes the tables and a chart
into docs/BENCHMARKS.md (between the compare-ceph marker comments) and docs/compare-ceph.svg.

What it does, in order:
  1. Ferrite, 1 replica: one `ferrite up` node (temp data dir, 4 sparse drive files, free ports),
     a volume of COMPARE_SIZE_GB, compression COMPARE_COMPRESSION. fio with ioengine=nbd on
     nbd://127.0.0.1:PORT/VOLUME: a write-fill (sequential 1 MiB over the whole volume), then
     the five workloads. Then pgbench on ext4 on a loop device over an nbdfuse file of the
     volume (scripts/pgbench-ext4.sh). The node is stopped and its drives deleted.
  2. Ferrite, 3 replicas: a private etcd and 3 `ferrite up` nodes in one cluster (each with its
     own data dir, drives and ports), a volume with --replicas 3, and the same fio and pgbench
     through the primary's NBD export. Each measurement records whether every replica stayed
     in sync (the primary's count of replicas it removed, the epoch, the in-sync set): a
     replica that fell behind and left the set (the machine stalled past half the lease, say)
     makes the writes land on fewer copies than Ceph's, and the report does not judge that
     workload's goals. The nodes are stopped and their drives deleted.

Like for like: Ceph's replicated pools keep no parity inside an OSD, so Ferrite's nodes run
with --erasure-coding none unless FERRITE_ERASURE_CODING says otherwise (Ferrite's default,
3+1 parity over a node's drives, costs writes; measure it with FERRITE_ERASURE_CODING=3+1).
  3. Ceph: ../shared/anchors/ceph/up.sh (1 mon, 1 mgr, 3 BlueStore OSDs on sparse files, on
     the same filesystem). A pool of size 1 (min_size 1) with an image of the same size is
     created beside the anchor's size-3 pool. For each: fio with ioengine=rbd, the same
     write-fill and the same five workloads, then the same pgbench on ext4 on a loop device
     over an rbd-fuse file of the image. Then down.sh stops Ceph and deletes its data.
  4. The disk bound (COMPARE_DISK_BOUND=1, the default), measured first: a file of
     COMPARE_SIZE_GB on the same filesystem, written once with sequential 1 MiB writes, then
     read at random in 4, 8, 16 and 32 KiB with ioengine=io_uring, the same depth and jobs. A
     storage system that does not serve reads from RAM reads no faster than its disk, so a
     workload whose share r of I/Os are reads cannot exceed the disk's random reads at its size
     divided by r, and 4 KiB writes cannot exceed the disk's sequential bandwidth over 4 KiB.
     The report says which goals lie above that bound: no such system meets them on this
     machine. Then the four workloads that write, each exactly as the systems get it, on the
     raw file: a peer figure for each IOPS goal (what the disk does with that very job), not a
     bound, since a log's sequential writes may cost the disk less than writes in place.
  5. scripts/compare-report.py turns the results into the tables and the chart.

One run is noisy on a shared machine. To repeat it and report medians, run it again with
COMPARE_WRITE_DOCS=0 and a COMPARE_OUT_DIR each, then
`scripts/compare-medians.py DIR1 DIR2 DIR3` prints the median of each run's own ratios. Each
run also leaves DIR/run.tar.xz (its results and the fio and pgbench outputs they name, about
20 KB), which compare-medians.py reads as well; a run that writes the docs keeps a copy in
docs/compare-runs/, so medians can take in the runs of earlier sessions.

fio is the same on both sides except the engine: iodepth 32 x 4 jobs, direct=1, random
offsets (norandommap, randrepeat=0), refill_buffers (fresh random, incompressible data on every
write), ramp then measured time, group_reporting, JSON with p50/p99/p99.9 of total latency.

CPU: the server's CPU time (utime+stime from /proc/PID/stat: the `ferrite up` process; Ceph's
mon, mgr, OSDs and radosgw) and fio's own (the client: libnbd or librbd) are read before and
after every workload, as is the whole host's busy time, so the table shows IOPS per server CPU
second and how much CPU other jobs on the machine took meanwhile. fio runs on the same CPUs as
the server, so the report also says, per workload, how much server CPU per I/O each IOPS goal
leaves on this machine (the vCPUs over the goal's rate, less fio's own CPU per I/O in Ferrite's
run) beside what each side's server took: a goal whose budget Ferrite's server exceeds needs
less CPU per I/O before it can be met here; one whose budget fio alone exhausts cannot be.

Disk stalls: scripts/disk-stall.py watches the block device under each side's data during every
workload (its /sys/block stat, every 50 ms) and the table shows the longest time it held
requests and completed none. A pause of the disk itself (on a virtual machine, the host's: one
of 0.25 s with 77 requests queued was seen under Ferrite's 32K mix) lands every request then in
flight in the latency tail, whichever system runs; the goals summary names such a stall beside
a missed p99.9 goal when it was long enough to set it.

Where a replicated write's time goes: while Ferrite's cluster runs, every node's /metrics is
scraped before and after each workload, and scripts/write-stages.py turns the differences into
the means (and shares over 10 ms) of the primary's host writes, its own log writes, its wait for
each replica's acknowledgement, each replica's log writes and each node's write-intent persists
(how many, and how long); the report sets them out per
workload under the replicated rows (the scrapes stay in logs/metrics-*.txt).

Environment (all optional):
  COMPARE_SIZE_GB       volume and RBD image size in GiB                 [4]
  COMPARE_RUNTIME       measured seconds per workload                    [30]
  COMPARE_RAMP          ramp seconds per workload (not measured)         [5]
  COMPARE_WORKLOADS     comma list from 4k_randread,4k_randwrite,8k_randrw_80_20,
                        16k_randrw_70_30,32k_randrw_50_50                [all five]
  COMPARE_IODEPTH       fio iodepth per job                              [32]
  COMPARE_NUMJOBS       fio jobs                                         [4]
  COMPARE_REPLICAS      replica counts to compare: 1 and/or 3            [1,3]
  COMPARE_SIDES         ferrite and/or ceph (one side alone is for trying the script;
                        the report then shows the other side as not run) [ferrite,ceph]
  COMPARE_COMPRESSION   the Ferrite volume's compression: off, lz4, zstd [off]
  COMPARE_PGBENCH       1 runs pgbench on both sides, 0 skips it          [1]
  COMPARE_DISK_BOUND    1 measures the disk bound (step 4), 0 skips it    [1]
  COMPARE_PGBENCH_TIME  pgbench seconds                                  [60]
  COMPARE_PGBENCH_SCALE pgbench scale factor (15 MiB each)               [10]
  COMPARE_PGBENCH_CLIENTS / COMPARE_PGBENCH_JOBS                        [4 / 2]
  COMPARE_LABEL         a line printed at the top of the report, such as
                        "short trial run"                                [none]
  COMPARE_WRITE_DOCS    1 writes docs/BENCHMARKS.md and docs/compare-ceph.svg,
                        0 leaves them alone (the report is still in COMPARE_OUT_DIR) [1]
  COMPARE_OUT_DIR       raw results: fio JSON, logs, results.jsonl, report.md
                        [/var/tmp/ferrite-compare-ceph/<timestamp>]
  COMPARE_MIN_FREE_GB   stop everything if the disk's free space falls below this [4]
  FERRITE_DRIVE_SIZE_GB each of Ferrite's 4 sparse drive files        [COMPARE_SIZE_GB/2+1, at least 2]
  FERRITE_ERASURE_CODING  parity over each Ferrite node's drives (K+M or none)  [none]
  FERRITE_BIN           the ferrite binary to measure (an A/B of two builds)
                        [target/release/ferrite, built if missing]
  FERRITE_UP_ARGS       extra arguments for `ferrite up` (such as --poll-us 200, or
                        --lay-out-drives: zeros written over Ferrite's drive files at
                        the first start, so its log never pays the filesystem's block
                        allocation; Ceph's OSD files stay sparse)  [none]
  CEPH_ANCHOR_DIR       the Ceph anchor scripts            [../shared/anchors/ceph]
  CEPH_DATA_DIR         the Ceph cluster's data            [/var/tmp/ceph-anchor]
  CEPH_OSD_SIZE_GB      each OSD's sparse block file; host disk use can grow to
                        3 x this                           [2 x COMPARE_SIZE_GB + 1, at least 6]
  KEEP_CEPH=1           leave the Ceph cluster running at the end (`. CEPH_DATA_DIR/env`
                        to use it; a later run reuses it; down.sh removes it)

Needs root (losetup, mount, FUSE), fio with the nbd and rbd engines, nbdfuse, rbd-fuse and
postgresql-15; the Ceph packages and rbd-fuse are installed with apt when missing. Disk: free
space for 3 x CEPH_OSD_SIZE_GB + 6 GiB (up.sh's own check; 33 GiB with the defaults). Time: about
25 minutes with the defaults, teardown included; the short trial below took 9.5 minutes before the
raw-disk jobs of the writing workloads were added (they add about 2.5 minutes at the defaults):

  COMPARE_RUNTIME=15 COMPARE_RAMP=3 COMPARE_SIZE_GB=2 COMPARE_PGBENCH_TIME=15 \
    COMPARE_LABEL="Short trial run" make compare-ceph

The machine's other jobs make the figures noisy: the "other CPU" column says how noisy.
EOF
}
case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    "") ;;
    *) echo "compare-ceph: unknown argument $1 (see --help)" >&2; exit 2 ;;
esac

# ---------------------------------------------------------------- settings
size_gb=${COMPARE_SIZE_GB:-4}
[[ "$size_gb" =~ ^[1-9][0-9]*$ ]] || { echo "compare-ceph: COMPARE_SIZE_GB='$size_gb' is not a whole number of GiB" >&2; exit 2; }
runtime_s=${COMPARE_RUNTIME:-30}
ramp_s=${COMPARE_RAMP:-5}
workloads=${COMPARE_WORKLOADS:-4k_randread,4k_randwrite,8k_randrw_80_20,16k_randrw_70_30,32k_randrw_50_50}
iodepth=${COMPARE_IODEPTH:-32}
numjobs=${COMPARE_NUMJOBS:-4}
replica_counts=${COMPARE_REPLICAS:-1,3}
sides=${COMPARE_SIDES:-ferrite,ceph}
compression=${COMPARE_COMPRESSION:-off}
pgbench_enabled=${COMPARE_PGBENCH:-1}
disk_bound_enabled=${COMPARE_DISK_BOUND:-1}
pgbench_time_s=${COMPARE_PGBENCH_TIME:-60}
pgbench_scale=${COMPARE_PGBENCH_SCALE:-10}
pgbench_clients=${COMPARE_PGBENCH_CLIENTS:-4}
pgbench_jobs=${COMPARE_PGBENCH_JOBS:-2}
write_docs=${COMPARE_WRITE_DOCS:-1}
min_free_gb=${COMPARE_MIN_FREE_GB:-4}
drive_size_gb=${FERRITE_DRIVE_SIZE_GB:-$((size_gb / 2 + 1))}
[ "$drive_size_gb" -ge 2 ] || drive_size_gb=2
ferrite_drive_count=4
erasure_coding=${FERRITE_ERASURE_CODING:-none}
anchor_dir=${CEPH_ANCHOR_DIR:-$repo/../shared/anchors/ceph}
ceph_dir=${CEPH_DATA_DIR:-/var/tmp/ceph-anchor}
osd_size_gb=${CEPH_OSD_SIZE_GB:-$((2 * size_gb + 1))}
[ "$osd_size_gb" -ge 6 ] || osd_size_gb=6
ceph_osd_count=3
ceph_conf=$ceph_dir/ceph.conf
ceph_size1_pool=compare-size1
ceph_size1_image=compare
volume=compare
out=${COMPARE_OUT_DIR:-/var/tmp/ferrite-compare-ceph/$(date +%Y%m%d-%H%M%S)}
results=$out/results.jsonl
ferrite=$out/bin/ferrite   # a copy of target/release/ferrite, made at the start
all_workloads="4k_randread 4k_randwrite 8k_randrw_80_20 16k_randrw_70_30 32k_randrw_50_50"

# The command as the user gave it, for the report: the knobs that were set (except the two that
# only say where the results go), then the entry point.
command_line=""
for knob in $(compgen -e | grep -E '^(COMPARE_[A-Z_]+|FERRITE_BIN|FERRITE_DRIVE_SIZE_GB|FERRITE_ERASURE_CODING|FERRITE_UP_ARGS|CEPH_ANCHOR_DIR|CEPH_DATA_DIR|CEPH_OSD_SIZE_GB|KEEP_CEPH)$' | grep -vE '^COMPARE_(OUT_DIR|WRITE_DOCS)$' | sort); do
    command_line+="$knob=${!knob@Q} "
done
if [ -n "${MAKELEVEL:-}" ]; then command_line+="make compare-ceph"; else command_line+="scripts/compare-ceph.sh"; fi

started_s=$(date +%s)
log() { printf '[compare %5ss] %s\n' "$(($(date +%s) - started_s))" "$*"; }
die() { log "ERROR: $*"; exit 1; }
is_number() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
for value in "$size_gb" "$runtime_s" "$iodepth" "$numjobs" "$pgbench_time_s" "$pgbench_scale" \
    "$pgbench_clients" "$pgbench_jobs" "$drive_size_gb" "$osd_size_gb" "$min_free_gb"; do
    is_number "$value" || die "'$value' is not a positive number (see --help)"
done
[[ "$ramp_s" =~ ^[0-9]+$ ]] || die "COMPARE_RAMP='$ramp_s' is not a number of seconds"
for workload in ${workloads//,/ }; do
    [[ " $all_workloads " == *" $workload "* ]] || die "unknown workload $workload (known: $all_workloads)"
done
for replicas in ${replica_counts//,/ }; do
    [ "$replicas" = 1 ] || [ "$replicas" = 3 ] || die "COMPARE_REPLICAS takes 1 and/or 3, not $replicas"
done
case "$compression" in off | lz4 | zstd) ;; *) die "COMPARE_COMPRESSION is off, lz4 or zstd" ;; esac
case "$disk_bound_enabled" in 0 | 1) ;; *) die "COMPARE_DISK_BOUND is 0 or 1" ;; esac
for side in ${sides//,/ }; do
    [ "$side" = ferrite ] || [ "$side" = ceph ] || die "COMPARE_SIDES takes ferrite and/or ceph, not $side"
done
has_side() { [[ ",$sides," == *",$1,"* ]]; }

# ---------------------------------------------------------------- what is running (for cleanup)
# Every process, mount and loop device this script creates is recorded here, and cleanup()
# releases exactly those: by PID and by path, never by name.
child_pid=""          # the long-running command being waited on (fio, up.sh, pgbench-ext4.sh)
stall_pid=""          # scripts/disk-stall.py watching the disk during a measurement
replication_api=""    # the API of the replicated volume's primary while Ferrite's cluster runs
guard_pid=""          # the free-disk guard
ferrite_pids=()       # `ferrite up` processes
ferrite_data_dirs=()  # their data dirs (drive files), deleted when they stop
fuse_pids=()          # nbdfuse / rbd-fuse processes
fuse_mounts=()        # their mountpoints
loop_devices=()       # loop devices attached by this script
pg_mounts=()          # where pgbench-ext4.sh mounts ext4 (and PostgreSQL runs)
ceph_started=0
raw_file=""           # the raw-disk file of the disk bound

ceph_cli() { timeout 120 ceph -c "$ceph_conf" --connect-timeout 20 "$@"; }
rbd_cli() { timeout 120 rbd -c "$ceph_conf" "$@"; }

wait_gone() {  # pid seconds: true once the process is gone
    local pid=$1 tries=$(($2 * 5))
    while kill -0 "$pid" 2>/dev/null && [ "$tries" -gt 0 ]; do sleep 0.2; tries=$((tries - 1)); done
    ! kill -0 "$pid" 2>/dev/null
}

release_pg_mount() {  # mountpoint: stop a PostgreSQL left on it, then unmount it
    local mnt=$1 pg_bin
    if [ -e "$mnt/pgdata/postmaster.pid" ]; then
        pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
        [ -n "$pg_bin" ] && runuser -u postgres -- "$pg_bin/pg_ctl" stop -w -m immediate -D "$mnt/pgdata" >/dev/null 2>&1 || true
    fi
    if mountpoint -q "$mnt" 2>/dev/null; then umount "$mnt" || umount -l "$mnt" || true; fi
}

release_fuse() {  # index into fuse_pids/fuse_mounts
    local i=$1 pid=${fuse_pids[$1]} mnt=${fuse_mounts[$1]}
    [ -n "$pid" ] || return 0
    if mountpoint -q "$mnt" 2>/dev/null; then
        fusermount3 -u "$mnt" 2>/dev/null || fusermount -u "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
    fi
    if ! wait_gone "$pid" 10; then kill -TERM "$pid" 2>/dev/null || true; wait_gone "$pid" 10 || kill -KILL "$pid" 2>/dev/null || true; fi
    wait "$pid" 2>/dev/null || true
    fuse_pids[i]=""
}

release_loop() {  # index into loop_devices
    local device=${loop_devices[$1]}
    [ -n "$device" ] || return 0
    losetup -d "$device" 2>/dev/null || log "could not detach $device"
    loop_devices[$1]=""
}

# Stops in the reverse order of the starts: the nodes before the etcd they report to, so each
# steps its volumes down through etcd instead of waiting out its step-down timeout.
stop_ferrite() {
    local pid dir i
    for ((i = ${#ferrite_pids[@]} - 1; i >= 0; i--)); do
        pid=${ferrite_pids[i]}
        [ -n "$pid" ] || continue
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            wait_gone "$pid" 60 || { log "ferrite pid $pid still running after 60 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
        fi
        wait "$pid" 2>/dev/null || true
    done
    ferrite_pids=()
    for dir in "${ferrite_data_dirs[@]}"; do rm -rf -- "$dir"; done
    ferrite_data_dirs=()
}

cleanup() {
    local rc=$? i
    trap - EXIT INT TERM
    set +e
    # A signal can land while a step's output is redirected to its log; report on the terminal.
    exec 1>&"$terminal_stdout" 2>&"$terminal_stderr"
    [ -n "$guard_pid" ] && kill "$guard_pid" 2>/dev/null && wait "$guard_pid" 2>/dev/null
    if [ -n "$stall_pid" ] && tr '\0' ' ' 2>/dev/null <"/proc/$stall_pid/cmdline" | grep -q disk-stall.py; then
        kill "$stall_pid" 2>/dev/null && wait "$stall_pid" 2>/dev/null
    fi
    if [ -n "$child_pid" ] && kill -0 "$child_pid" 2>/dev/null; then
        log "stopping the running step (pid $child_pid)"
        kill -TERM "$child_pid" 2>/dev/null
        wait_gone "$child_pid" 90 || kill -KILL "$child_pid" 2>/dev/null
        wait "$child_pid" 2>/dev/null
    fi
    for i in "${!pg_mounts[@]}"; do release_pg_mount "${pg_mounts[$i]}"; done
    for i in "${!loop_devices[@]}"; do release_loop "$i"; done
    for i in "${!fuse_pids[@]}"; do release_fuse "$i"; done
    stop_ferrite
    [ -n "$raw_file" ] && rm -f -- "$raw_file"
    if [ "$ceph_started" = 1 ]; then
        if [ "${KEEP_CEPH:-0}" = 1 ]; then
            log "KEEP_CEPH=1: Ceph keeps running; use it with '. $ceph_dir/env', remove it with $anchor_dir/down.sh"
        else
            CEPH_DATA_DIR="$ceph_dir" bash "$anchor_dir/down.sh" 2>&1 | sed 's/^/    /'
        fi
    fi
    rm -f -- "$ferrite"   # the copy of the binary (55 MB); the results stay
    [ -e "$out/DISK_LOW" ] && log "stopped because the disk's free space fell below $min_free_gb GiB"
    case "$rc" in
        0) ;;
        130 | 143) log "interrupted; everything it started is stopped; logs in $out/logs" ;;
        *) log "failed (exit $rc); everything it started is stopped; logs in $out/logs" ;;
    esac
    exit "$rc"
}
exec {terminal_stdout}>&1 {terminal_stderr}>&2
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Runs a command in the background and waits for it, so that a signal (Ctrl-C, the disk guard)
# reaches cleanup() at once instead of after the command ends.
run_child() {
    local rc=0
    "$@" &
    child_pid=$!
    wait "$child_pid" || rc=$?
    child_pid=""
    return "$rc"
}

free_gb() { df -BG --output=avail "$1" | tail -1 | tr -dc 0-9; }
need_free() {  # gigabytes why
    local have
    have=$(free_gb "$out")
    [ "$have" -ge "$1" ] || die "only $have GiB free on the filesystem of $out; $2 needs $1 GiB. Free disk or lower COMPARE_SIZE_GB / CEPH_OSD_SIZE_GB."
    log "disk: $have GiB free ($2 needs $1 GiB)"
}

# ---------------------------------------------------------------- CPU accounting
clock_ticks=$(getconf CLK_TCK)
process_ticks() {  # pid... -> utime+stime of those processes (all threads), in clock ticks
    local total=0 pid stat fields
    for pid in "$@"; do
        stat=$(cat "/proc/$pid/stat" 2>/dev/null) || continue
        read -ra fields <<<"${stat##*) }"
        total=$((total + fields[11] + fields[12]))
    done
    echo "$total"
}
children_ticks() {  # CPU of this shell's finished, waited-for children (cutime+cstime): fio
    local stat fields
    stat=$(cat /proc/$$/stat)
    read -ra fields <<<"${stat##*) }"
    echo $((fields[13] + fields[14]))
}
host_busy_ticks() {  # user+nice+system+irq+softirq+steal of all CPUs
    awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat
}
ceph_pids() {  # the daemons up.sh started, only while they still run with our ceph.conf
    local file pid
    for file in "$ceph_dir"/run/*.pid; do
        [ -e "$file" ] || continue
        pid=$(cat "$file" 2>/dev/null || true)
        [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || continue
        tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$ceph_conf" && echo "$pid"
    done
    return 0
}

server_pids=()   # whose CPU counts as the storage system's: set per side
stall_dir=$out   # the directory whose disk scripts/disk-stall.py watches: set per side
measure_count=0
measure_begin() {
    [ -n "$stall_pid" ] && wait "$stall_pid" 2>/dev/null  # the last watcher, stopped by measure_json
    measure_count=$((measure_count + 1))
    stall_file=$out/logs/disk-stall-$measure_count.json
    python3 "$repo/scripts/disk-stall.py" "$stall_dir" >"$stall_file" 2>>"$out/logs/disk-stall.log" &
    stall_pid=$!
    # Before the CPU counters are read, so the query's own CPU is not counted as fio's.
    [ -z "$replication_api" ] || measure_replication0=$(replication_state)
    scrape_metrics before
    measure_t0=$(date +%s.%N)
    measure_server0=$(process_ticks "${server_pids[@]}")
    measure_client0=$(children_ticks)
    measure_host0=$(host_busy_ticks)
}
# Every node's metrics into logs/metrics-N-NODE-WHEN.txt (replicated Ferrite only), for
# scripts/write-stages.py. A failed scrape leaves the file empty: its stages are then missing.
metrics_names=()  # the cluster's node names, and their REST APIs: set while it runs
metrics_apis=()
metrics_primary=""
scrape_metrics() {  # when
    local i
    for i in "${!metrics_apis[@]}"; do
        curl -sf --max-time 5 "${metrics_apis[$i]}/metrics" \
            >"$out/logs/metrics-$measure_count-${metrics_names[$i]}-$1.txt" 2>/dev/null || true
    done
}
# -> ', "write_stages": {...}': where the replicated writes' time went (scripts/write-stages.py)
write_stages_json() {
    local i nodes=() stages
    for i in "${!metrics_names[@]}"; do
        nodes+=("${metrics_names[$i]}=$out/logs/metrics-$measure_count-${metrics_names[$i]}-before.txt,$out/logs/metrics-$measure_count-${metrics_names[$i]}-after.txt")
    done
    stages=$(python3 "$repo/scripts/write-stages.py" --volume "$volume" --primary "$metrics_primary" "${nodes[@]}" \
        2>>"$out/logs/write-stages.log") || stages=null
    printf ', "write_stages": %s' "${stages:-null}"
}
# -> "REMOVED EPOCH IN_SYNC PRIMARY" of the replicated volume, as its primary answers (a
# failed query gives "? ? ? ?": the check then fails, never passes, by mistake)
replication_state() {
    "$ferrite" volume show "$volume" --json --api "$replication_api" 2>/dev/null |
        jq -r '.replication | "\(.local.replicas_removed // "?") \(.epoch) \(.in_sync | length) \(.primary // "?")"' 2>/dev/null ||
        echo "? ? ? ?"
}
measure_json() {  # -> the JSON fields of the CPU spent since measure_begin
    local t1 server1 client1 host1
    t1=$(date +%s.%N)
    server1=$(process_ticks "${server_pids[@]}")
    client1=$(children_ticks)
    host1=$(host_busy_ticks)
    awk -v t0="$measure_t0" -v t1="$t1" -v s="$((server1 - measure_server0))" -v c="$((client1 - measure_client0))" \
        -v h="$((host1 - measure_host0))" -v hz="$clock_ticks" \
        'BEGIN { printf "\"wall_s\": %.3f, \"server_cpu_s\": %.2f, \"client_cpu_s\": %.2f, \"host_busy_cpu_s\": %.2f", t1 - t0, s / hz, c / hz, h / hz }'
    # The watcher prints its findings when it stops (this runs in a subshell, which cannot
    # wait for it: its output file is the sign). Its CPU is not fio's: it stops after
    # client1 was read.
    local i
    kill -TERM "$stall_pid" 2>/dev/null
    for i in $(seq 1 50); do [ -s "$stall_file" ] && break; sleep 0.1; done
    jq -j '", \"disk\": \(.disk | tojson), \"disk_stall_max_ms\": \(.stall_max_ms // null), \"disk_stalls_100ms\": \(.stalls_100ms // null)"' \
        "$stall_file" 2>/dev/null || printf ', "disk": null, "disk_stall_max_ms": null, "disk_stalls_100ms": null'
    if [ ${#metrics_apis[@]} -gt 0 ]; then
        scrape_metrics after
        write_stages_json
    fi
    [ -n "$replication_api" ] || return 0
    # Whether every replica stayed in sync: no removal by the primary, no failover, the whole
    # set in sync at the start and at the end (a removal and its resync within the run count
    # too).
    local removed0 epoch0 in_sync0 removed1 epoch1 in_sync1 primary1 _
    read -r removed0 epoch0 in_sync0 _ <<<"$measure_replication0"
    read -r removed1 epoch1 in_sync1 primary1 <<<"$(replication_state)"
    awk -v r0="$removed0" -v r1="$removed1" -v e0="$epoch0" -v e1="$epoch1" -v n0="$in_sync0" -v n1="$in_sync1" -v p="$primary1" \
        'function num(x) { return x ~ /^[0-9]+$/ }
         function or_null(x) { return num(x) ? x : "null" }
         BEGIN { known = num(r0) && num(r1) && num(e0) && num(e1) && num(n0) && num(n1)
                 printf ", \"replication\": {\"known\": %s, \"replicas_removed\": %s, \"epoch_changed\": %s, \"in_sync_at_start\": %s, \"in_sync_at_end\": %s, \"primary\": \"%s\"}",
                        known ? "true" : "false", known ? r1 - r0 : "null", known ? (e1 != e0 ? "true" : "false") : "null",
                        or_null(n0), or_null(n1), p }'
}

record() { echo "{$1}" >>"$results"; }
# Logs when the last record's measurement lost a replica from the in-sync set (or could not tell).
replication_warning() {  # what
    local said
    said=$(tail -1 "$results" | jq -r '.replicas as $replicas | .replication // empty
        | if .known != true then "could not tell whether every replica stayed in sync"
          elif .replicas_removed > 0 or .epoch_changed or .in_sync_at_start < $replicas or .in_sync_at_end < $replicas then
            "not every replica was in sync throughout (\(.replicas_removed) removed, epoch changed: \(.epoch_changed), in sync \(.in_sync_at_start) at the start and \(.in_sync_at_end) at the end): not like for like, not judged"
          else empty end')
    [ -z "$said" ] || log "WARNING: $1: $said"
}
not_run() {  # side replicas reason
    record "\"kind\": \"not_run\", \"side\": \"$1\", \"replicas\": $2, \"reason\": \"$3\""
    log "$1 with $2 replicas: not run: $3"
}

# ---------------------------------------------------------------- fio
workload_args() {  # workload -> rw, rwmixread, bs (the five standard workloads, as bench.sh)
    case "$1" in
        4k_randread) echo "randread 100 4k" ;;
        4k_randwrite) echo "randwrite 0 4k" ;;
        8k_randrw_80_20) echo "randrw 80 8k" ;;
        16k_randrw_70_30) echo "randrw 70 16k" ;;
        32k_randrw_50_50) echo "randrw 50 32k" ;;
    esac
}

# side replicas label target-args...: the write-fill, then every workload, each in its own fio run
fio_suite() {
    local side=$1 replicas=$2 label=$3 workload rw mix bs json
    shift 3
    local target=("$@")
    json=$out/fio/$label-fill.json
    log "$label: write-fill (sequential 1 MiB writes over the whole ${size_gb} GiB, iodepth 16)"
    measure_begin
    run_child fio --name="$label-fill" "${target[@]}" --direct=1 --rw=write --bs=1M --iodepth=16 \
        --numjobs=1 --refill_buffers=1 --output-format=json --output="$json" >"$out/logs/$label-fill.log" 2>&1 ||
        { tail -20 "$out/logs/$label-fill.log"; die "$label: fio write-fill failed"; }
    record "\"kind\": \"fill\", \"side\": \"$side\", \"replicas\": $replicas, \"fio_json\": \"$json\", $(measure_json)"
    log "$label: filled: $(jq -r '.jobs[0].write | "\(.io_bytes / 1073741824 * 100 | round / 100) GiB at \(.bw_bytes / 1e6 | round) MB/s"' "$json")"
    for workload in ${workloads//,/ }; do
        read -r rw mix bs <<<"$(workload_args "$workload")"
        json=$out/fio/$label-$workload.json
        measure_begin
        run_child fio --name="$label-$workload" "${target[@]}" --direct=1 --rw="$rw" --rwmixread="$mix" \
            --bs="$bs" --iodepth="$iodepth" --numjobs="$numjobs" --group_reporting --time_based \
            --ramp_time="$ramp_s" --runtime="$runtime_s" --norandommap --randrepeat=0 --refill_buffers=1 \
            --lat_percentiles=1 --percentile_list=50:99:99.9 --unified_rw_reporting=both \
            --output-format=json --output="$json" >"$out/logs/$label-$workload.log" 2>&1 ||
            { tail -20 "$out/logs/$label-$workload.log"; die "$label: fio $workload failed"; }
        record "\"kind\": \"fio\", \"side\": \"$side\", \"replicas\": $replicas, \"workload\": \"$workload\", \"fio_json\": \"$json\", $(measure_json)"
        log "$label $workload: $(jq -r '.jobs[0].mixed | "\(.iops | round) IOPS, p99.9 \(.lat_ns.percentile["99.900000"] / 1000 | round) us"' "$json") ($(tail -1 "$results" | jq -r '"server CPU \(.server_cpu_s) s, fio CPU \(.client_cpu_s) s, host busy \(.host_busy_cpu_s) s in \(.wall_s) s"'))"
        replication_warning "$label $workload"
    done
}

# ---------------------------------------------------------------- pgbench
# side replicas label device-file: a loop device with 4 KiB sectors over the file (an nbdfuse or
# rbd-fuse file), then scripts/pgbench-ext4.sh on it.
pgbench_on_file() {
    local side=$1 replicas=$2 label=$3 file=$4 device mnt=$out/mnt/pgbench index
    device=$(losetup --find --show --sector-size 4096 "$file") || die "$label: losetup on $file failed"
    loop_devices+=("$device")
    index=$((${#loop_devices[@]} - 1))
    pg_mounts+=("$mnt")
    log "$label: pgbench on ext4 on $device (scale $pgbench_scale, $pgbench_clients clients, $pgbench_jobs jobs, ${pgbench_time_s} s)"
    measure_begin
    run_child scripts/pgbench-ext4.sh --scale "$pgbench_scale" --clients "$pgbench_clients" --jobs "$pgbench_jobs" \
        --time "$pgbench_time_s" "$device" "$mnt" >"$out/logs/$label-pgbench.log" 2>&1 ||
        { tail -20 "$out/logs/$label-pgbench.log"; die "$label: pgbench failed"; }
    record "\"kind\": \"pgbench\", \"side\": \"$side\", \"replicas\": $replicas, \"log\": \"$out/logs/$label-pgbench.log\", $(measure_json)"
    log "$label: $(grep -E '^(tps|latency average)' "$out/logs/$label-pgbench.log" | tr '\n' ' ')"
    release_pg_mount "$mnt"
    release_loop "$index"
}

wait_for_file_size() {  # file bytes fuse-pid what
    local tries=600
    until [ "$(stat -c %s "$1" 2>/dev/null || echo 0)" = "$2" ]; do
        kill -0 "$3" 2>/dev/null || die "$4 exited before its file appeared (see $out/logs)"
        tries=$((tries - 1))
        [ "$tries" -gt 0 ] || die "$4 did not show $1 with $2 bytes within 60 s"
        sleep 0.1
    done
}

# ---------------------------------------------------------------- Ferrite

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Starts one `ferrite up` node with its own data dir and free ports; sets node_api and node_nbd.
start_ferrite_node() {  # name
    local name=$1 dir=$out/ferrite-$1 api_port nvme_port nbd_port pid
    api_port=$(port); nvme_port=$(port); nbd_port=$(port)
    need_free $((ferrite_drive_count * drive_size_gb + min_free_gb)) "Ferrite node $name ($ferrite_drive_count sparse drives of $drive_size_gb GiB)"
    ferrite_data_dirs+=("$dir")
    # shellcheck disable=SC2086 # FERRITE_UP_ARGS is a list of arguments
    "$ferrite" up --data-dir "$dir" --drives "$ferrite_drive_count" --drive-size "${drive_size_gb}G" \
        --erasure-coding "$erasure_coding" --api-listen "127.0.0.1:$api_port" --nvme-listen "127.0.0.1:$nvme_port" \
        --nbd-listen "127.0.0.1:$nbd_port" ${FERRITE_UP_ARGS:-} >"$out/logs/ferrite-$name.log" 2>&1 &
    pid=$!
    ferrite_pids+=("$pid")
    node_api=http://127.0.0.1:$api_port
    node_nbd=127.0.0.1:$nbd_port
    for _ in $(seq 1 300); do
        kill -0 "$pid" 2>/dev/null || { tail -20 "$out/logs/ferrite-$name.log"; die "ferrite up ($name) exited"; }
        "$ferrite" node show --api "$node_api" >/dev/null 2>&1 && { log "ferrite node $name up (pid $pid, NBD $node_nbd, API $node_api)"; return; }
        sleep 0.1
    done
    die "ferrite node $name did not answer on $node_api within 30 s"
}

# fio, then pgbench, on a Ferrite volume exported over NBD at nbd_uri.
ferrite_measure() {  # replicas nbd_uri
    local replicas=$1 uri=$2 label="ferrite-r$1" fuse_dir file pid
    stall_dir=$out
    fio_suite ferrite "$replicas" "$label" --ioengine=nbd --uri="$uri"
    [ "$pgbench_enabled" = 1 ] || return 0
    fuse_dir=$out/mnt/fuse-$label
    mkdir -p "$fuse_dir"
    file=$fuse_dir/$volume
    nbdfuse "$file" "$uri" </dev/null >"$out/logs/$label-nbdfuse.log" 2>&1 &
    pid=$!
    fuse_pids+=("$pid"); fuse_mounts+=("$fuse_dir")
    wait_for_file_size "$file" $((size_gb * 1073741824)) "$pid" nbdfuse
    pgbench_on_file ferrite "$replicas" "$label" "$file"
    release_fuse $((${#fuse_pids[@]} - 1))
}

ferrite_single() {
    log "== Ferrite, 1 replica: one node =="
    start_ferrite_node node1
    server_pids=("${ferrite_pids[@]}")
    "$ferrite" volume create "$volume" --size "${size_gb}G" --compression "$compression" --api "$node_api" >"$out/logs/ferrite-volume.log"
    ferrite_measure 1 "nbd://$node_nbd/$volume"
    "$ferrite" node show --api "$node_api" >"$out/logs/ferrite-node-show.txt" 2>&1 || true
    stop_ferrite
    log "ferrite stopped; its drives are deleted"
}

# The Ferrite row for more than one replica: a private etcd and REPLICAS nodes joined into one
# cluster on this machine (each its own data dir, drives and ports, as start_ferrite_node makes
# them), the volume created with --replicas REPLICAS, fio and pgbench through the primary's NBD
# export. Every node's CPU counts as the server's.
ferrite_replicated() {  # replicas
    local replicas=$1 etcd_dir=$out/etcd etcd_port peer_port etcd_pid i primary nbd
    log "== Ferrite, $replicas replicas: $replicas nodes in one cluster =="
    command -v etcd >/dev/null || die "etcd is not installed (scripts/deps.sh installs etcd-server)"
    etcd_port=$(port); peer_port=$(port)
    mkdir -p "$etcd_dir"
    etcd --name compare --data-dir "$etcd_dir" \
        --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-cluster "compare=http://127.0.0.1:$peer_port" >"$out/logs/etcd-r$replicas.log" 2>&1 &
    etcd_pid=$!
    ferrite_pids+=("$etcd_pid")
    ferrite_data_dirs+=("$etcd_dir")
    local apis=()
    for i in $(seq 1 "$replicas"); do
        FERRITE_UP_ARGS="${FERRITE_UP_ARGS:-} --cluster-etcd http://127.0.0.1:$etcd_port --cluster-name compare --node-name node$i --replication-listen 127.0.0.1:$(port)" \
            start_ferrite_node "r$replicas-node$i"
        apis+=("$node_api")
        metrics_names+=("node$i")
    done
    server_pids=("${ferrite_pids[@]}")
    "$ferrite" volume create "$volume" --size "${size_gb}G" --compression "$compression" --replicas "$replicas" \
        --api "${apis[0]}" >"$out/logs/ferrite-volume-r$replicas.log"
    # The manager promotes a primary within a second or so; its NBD export then serves.
    primary=""
    for _ in $(seq 1 300); do
        primary=$("$ferrite" volume show "$volume" --json --api "${apis[0]}" 2>/dev/null | jq -r '.replication.primary // empty')
        [ -n "$primary" ] && [ "$("$ferrite" volume show "$volume" --json --api "${apis[0]}" | jq '.replication.in_sync | length')" = "$replicas" ] && break
        sleep 0.1
    done
    [ -n "$primary" ] || die "no primary for $volume within 30 s (see $out/logs/ferrite-r$replicas-node*.log)"
    nbd=$("$ferrite" node list --json --api "${apis[0]}" | jq -r --arg name "$primary" '.[] | select(.name == $name) | .nbd_addr // empty')
    [ -n "$nbd" ] || die "cannot find the NBD address of the primary $primary"
    log "primary of $volume: $primary (NBD $nbd)"
    replication_api=http://$("$ferrite" node list --json --api "${apis[0]}" | jq -r --arg name "$primary" '.[] | select(.name == $name) | .api_addr // empty')
    [ "$replication_api" != http:// ] || die "cannot find the API address of the primary $primary"
    sleep 1
    metrics_apis=("${apis[@]}")
    metrics_primary=$primary
    ferrite_measure "$replicas" "nbd://$nbd/$volume"
    replication_api=""
    metrics_apis=(); metrics_names=(); metrics_primary=""
    "$ferrite" cluster status --api "${apis[0]}" >"$out/logs/ferrite-cluster-r$replicas.txt" 2>&1 || true
    "$ferrite" volume show "$volume" --api "${apis[0]}" >>"$out/logs/ferrite-cluster-r$replicas.txt" 2>&1 || true
    stop_ferrite
    log "ferrite cluster stopped; its drives are deleted"
}

# ---------------------------------------------------------------- disk bound
# What the disk allows (see --help, step 4): its sequential writes, then its random reads at each
# I/O size, with the same fio depth and jobs as the workloads; then the workloads that write,
# each as the systems get it.
disk_bound() {
    local bs json label=disk-bound
    log "== Disk bound: the raw disk with the same fio jobs =="
    need_free $((size_gb + min_free_gb)) "the raw-disk file (${size_gb} GiB)"
    raw_file=$out/raw-disk.dat
    server_pids=()
    stall_dir=$out
    json=$out/fio/$label-raw-fill.json
    measure_begin
    run_child fio --name=raw-fill --filename="$raw_file" --size="${size_gb}G" --ioengine=io_uring --direct=1 \
        --rw=write --bs=1M --iodepth=16 --output-format=json --output="$json" >"$out/logs/$label-raw-fill.log" 2>&1 ||
        { tail -20 "$out/logs/$label-raw-fill.log"; die "raw disk: fio write-fill failed"; }
    record "\"kind\": \"fill\", \"side\": \"raw-disk\", \"replicas\": 1, \"fio_json\": \"$json\", $(measure_json)"
    for bs in 4k 8k 16k 32k; do
        json=$out/fio/$label-raw-randread-$bs.json
        measure_begin
        run_child fio --name="raw-randread-$bs" --filename="$raw_file" --size="${size_gb}G" --ioengine=io_uring \
            --direct=1 --rw=randread --bs="$bs" --iodepth="$iodepth" --numjobs="$numjobs" --group_reporting \
            --time_based --ramp_time="$ramp_s" --runtime="$runtime_s" --norandommap --randrepeat=0 \
            --lat_percentiles=1 --percentile_list=50:99:99.9 --unified_rw_reporting=both \
            --output-format=json --output="$json" >"$out/logs/$label-raw-randread-$bs.log" 2>&1 ||
            { tail -20 "$out/logs/$label-raw-randread-$bs.log"; die "raw disk: fio randread $bs failed"; }
        record "\"kind\": \"probe\", \"probe\": \"raw_randread_$bs\", \"fio_json\": \"$json\", $(measure_json)"
        log "raw disk, random reads of $bs: $(jq -r '.jobs[0].mixed.iops | round' "$json") IOPS"
    done
    # The workloads that write, exactly as the systems get them: a peer figure, not a bound (a
    # log writes sequentially, which may cost the disk less than these writes in place).
    local workload rw mix
    for workload in ${workloads//,/ }; do
        read -r rw mix bs <<<"$(workload_args "$workload")"
        [ "$rw" = randread ] && continue
        json=$out/fio/$label-raw-$workload.json
        measure_begin
        run_child fio --name="raw-$workload" --filename="$raw_file" --size="${size_gb}G" --ioengine=io_uring \
            --direct=1 --rw="$rw" --rwmixread="$mix" --bs="$bs" --iodepth="$iodepth" --numjobs="$numjobs" \
            --group_reporting --time_based --ramp_time="$ramp_s" --runtime="$runtime_s" --norandommap \
            --randrepeat=0 --refill_buffers=1 --lat_percentiles=1 --percentile_list=50:99:99.9 \
            --unified_rw_reporting=both --output-format=json --output="$json" >"$out/logs/$label-raw-$workload.log" 2>&1 ||
            { tail -20 "$out/logs/$label-raw-$workload.log"; die "raw disk: fio $workload failed"; }
        record "\"kind\": \"probe\", \"probe\": \"raw_job_$workload\", \"fio_json\": \"$json\", $(measure_json)"
        log "raw disk, $workload: $(jq -r '.jobs[0].mixed.iops | round' "$json") IOPS"
    done
    rm -f -- "$raw_file"
    raw_file=""
}

# ---------------------------------------------------------------- Ceph
ceph_pgs_clean() {
    ceph_cli pg stat -f json | jq -e '(.pg_summary.num_pgs // .num_pgs) as $n
        | ([(.pg_summary.num_pg_by_state // .num_pg_by_state)[] | select(.name == "active+clean") | .num] | add // 0) as $c
        | $n > 0 and $c == $n' >/dev/null
}

ceph_up() {
    log "== Ceph Pacific: $anchor_dir/up.sh ($ceph_osd_count OSDs of $osd_size_gb GiB, image ${size_gb} GiB) =="
    if [ -e "$ceph_dir" ] && [ ! -e "$ceph_dir/.compare-ceph" ]; then
        die "$ceph_dir holds a Ceph cluster this script did not start (another anchor run?); stop it with $anchor_dir/down.sh or set CEPH_DATA_DIR"
    fi
    if [ ! -e "$ceph_dir/.bootstrapped" ]; then
        # up.sh refuses with less than this too; checking here says it before anything starts
        need_free $((ceph_osd_count * osd_size_gb + 6)) "Ceph ($ceph_osd_count OSD files that can grow to $osd_size_gb GiB each, + 6 GiB)"
    fi
    ceph_started=1
    run_child env CEPH_DATA_DIR="$ceph_dir" CEPH_OSD_COUNT="$ceph_osd_count" CEPH_OSD_SIZE_GB="$osd_size_gb" \
        CEPH_RBD_SIZE_GB="$size_gb" bash "$anchor_dir/up.sh" >"$out/logs/ceph-up.log" 2>&1 ||
        { tail -30 "$out/logs/ceph-up.log"; die "up.sh failed (log: $out/logs/ceph-up.log)"; }
    touch "$ceph_dir/.compare-ceph"
    # shellcheck disable=SC1091
    . "$ceph_dir/env"
    export CEPH_CONF
    anchor_pool=$CEPH_ANCHOR_RBD_POOL
    anchor_image=$CEPH_ANCHOR_RBD_IMAGE
    local bytes
    bytes=$(rbd_cli info "$anchor_pool/$anchor_image" --format json | jq .size)
    [ "$bytes" = $((size_gb * 1073741824)) ] ||
        die "the anchor's image $anchor_pool/$anchor_image holds $bytes bytes, not ${size_gb} GiB (a kept cluster from another size?): run $anchor_dir/down.sh"
    log "ceph up: $(ceph --version | awk '{print $3, $5}'), image $anchor_pool/$anchor_image (size $(ceph_cli osd pool get "$anchor_pool" size -f json | jq .size))"
}

# A second RBD pool holding one copy of each object (size 1, min_size 1), for the 1-replica row.
ceph_size1_pool() {
    if ! ceph_cli osd pool ls | grep -qx "$ceph_size1_pool"; then
        local pg_num
        pg_num=$(ceph_cli osd pool get "$anchor_pool" pg_num -f json | jq .pg_num)
        ceph_cli config set global mon_allow_pool_size_one true >>"$out/logs/ceph-cli.log" 2>&1
        ceph_cli osd pool create "$ceph_size1_pool" "$pg_num" "$pg_num" replicated >>"$out/logs/ceph-cli.log" 2>&1
        ceph_cli osd pool set "$ceph_size1_pool" min_size 1 >>"$out/logs/ceph-cli.log" 2>&1
        ceph_cli osd pool set "$ceph_size1_pool" size 1 --yes-i-really-mean-it >>"$out/logs/ceph-cli.log" 2>&1
        ceph_cli osd pool application enable "$ceph_size1_pool" rbd >>"$out/logs/ceph-cli.log" 2>&1
        rbd_cli pool init "$ceph_size1_pool" >>"$out/logs/ceph-cli.log" 2>&1
        log "pool $ceph_size1_pool created (pg_num $pg_num, size 1, min_size 1)"
    fi
    if ! rbd_cli info "$ceph_size1_pool/$ceph_size1_image" >/dev/null 2>&1; then
        rbd_cli create --size "${size_gb}G" --image-feature layering "$ceph_size1_pool/$ceph_size1_image"
        log "image $ceph_size1_pool/$ceph_size1_image created (${size_gb} GiB, layering only, as the anchor's)"
    fi
    local tries=300
    until ceph_pgs_clean; do
        tries=$((tries - 1)); [ "$tries" -gt 0 ] || die "Ceph PGs not active+clean after 300 s"
        sleep 1
    done
    [ "$(ceph_cli osd pool get "$ceph_size1_pool" size -f json | jq .size)" = 1 ] || die "pool $ceph_size1_pool is not size 1"
}

ceph_measure() {  # replicas pool image
    local replicas=$1 pool=$2 image=$3 label="ceph-r$1" fuse_dir file pid
    log "== Ceph, $replicas replica(s): $pool/$image =="
    server_pids=()
    mapfile -t server_pids < <(ceph_pids)
    [ "${#server_pids[@]}" -gt 0 ] || die "no Ceph daemon PIDs under $ceph_dir/run"
    stall_dir=$ceph_dir
    ceph_cli -s >"$out/logs/$label-ceph-status.txt" 2>&1 || true
    fio_suite ceph "$replicas" "$label" --ioengine=rbd --clientname=admin --pool="$pool" --rbdname="$image"
    [ "$pgbench_enabled" = 1 ] || return 0
    fuse_dir=$out/mnt/fuse-$label
    mkdir -p "$fuse_dir"
    file=$fuse_dir/$image
    rbd-fuse -c "$ceph_conf" -p "$pool" -r "$image" "$fuse_dir" -f </dev/null >"$out/logs/$label-rbd-fuse.log" 2>&1 &
    pid=$!
    fuse_pids+=("$pid"); fuse_mounts+=("$fuse_dir")
    wait_for_file_size "$file" $((size_gb * 1073741824)) "$pid" rbd-fuse
    pgbench_on_file ceph "$replicas" "$label" "$file"
    release_fuse $((${#fuse_pids[@]} - 1))
}

# ---------------------------------------------------------------- preflight
[ "$(id -u)" -eq 0 ] || die "needs root (losetup, mount, FUSE, apt for the Ceph packages)"
[ -x "$anchor_dir/up.sh" ] || [ -f "$anchor_dir/up.sh" ] || die "no Ceph anchor at $anchor_dir (set CEPH_ANCHOR_DIR)"
mkdir -p "$out/fio" "$out/logs" "$out/bin" "$out/mnt"
chmod 755 "$out" "$out/mnt"   # pgbench-ext4.sh's postgres user walks down to its mount
: >"$results"
if [ -n "${FERRITE_BIN:-}" ]; then
    [ -x "$FERRITE_BIN" ] || die "FERRITE_BIN=$FERRITE_BIN is not an executable"
else
    [ -x target/release/ferrite ] || cargo build --release --locked --bin ferrite
fi
# A copy, so that a rebuild by someone else during the run cannot change the binary under us.
cp "${FERRITE_BIN:-target/release/ferrite}" "$ferrite"
command -v fio >/dev/null && command -v curl >/dev/null || scripts/deps.sh
fio --enghelp 2>/dev/null | grep -qw nbd || die "this fio has no nbd engine"
if [ "$pgbench_enabled" = 1 ]; then
    command -v nbdfuse >/dev/null && [ -x /usr/lib/postgresql/15/bin/pgbench ] || scripts/deps.sh
    if ! command -v rbd-fuse >/dev/null; then
        log "installing rbd-fuse with apt"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends rbd-fuse >"$out/logs/apt.log" 2>&1 ||
            { apt-get update -q >>"$out/logs/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends rbd-fuse >>"$out/logs/apt.log" 2>&1; } ||
            die "could not install rbd-fuse (see $out/logs/apt.log)"
    fi
    [ -e /dev/fuse ] || die "no /dev/fuse: nbdfuse and rbd-fuse need it"
fi

# Stops everything if the disk runs low: a full disk stops every process on the machine.
(
    while sleep 5; do
        have_mb=$(df -BM --output=avail "$out" | tail -1 | tr -dc 0-9)
        if [ "$have_mb" -lt $((min_free_gb * 1024)) ]; then
            echo "compare-ceph: only $have_mb MiB free on the disk: stopping everything" >&2
            touch "$out/DISK_LOW"
            kill -TERM $$
            exit 0
        fi
    done
) &
guard_pid=$!

# The commit checked out at the start, read from .git's files (HEAD, then the ref it names).
git_commit() {
    local head ref
    head=$(cat .git/HEAD 2>/dev/null) || { echo unknown; return; }
    if [[ "$head" != "ref: "* ]]; then echo "${head:0:12}"; return; fi
    ref=${head#ref: }
    if [ -f ".git/$ref" ]; then cut -c1-12 ".git/$ref"; return; fi
    awk -v ref="$ref" '$2 == ref { print substr($1, 1, 12); found = 1 } END { if (!found) print "unknown" }' .git/packed-refs 2>/dev/null || echo unknown
}

{
    printf '{"kind": "meta", "date_utc": "%s", "commit": "%s", "command": %s, "label": %s, ' "$(date -u +%FT%TZ)" "$(git_commit)" \
        "$(jq -Rn --arg c "$command_line" '$c')" "$(jq -Rn --arg c "${COMPARE_LABEL:-}" '$c')"
    printf '"host_cpus": %s, "host_mem_mib": %s, "kernel": "%s", "fio": "%s", ' "$(nproc)" \
        "$(free -m | awk '/^Mem:/{print $2}')" "$(uname -r)" "$(fio --version)"
    printf '"ferrite": "%s", "ferrite_binary_mtime": "%s", ' "$("$ferrite" --version | tr -d '\n')" \
        "$(date -u -r target/release/ferrite +%FT%TZ)"
    printf '"size_gb": %s, "runtime_s": %s, "ramp_s": %s, "iodepth": %s, "numjobs": %s, ' \
        "$size_gb" "$runtime_s" "$ramp_s" "$iodepth" "$numjobs"
    printf '"workloads": "%s", "compression": "%s", "ferrite_drives": "%s x %s GiB", ' "$workloads" "$compression" \
        "$ferrite_drive_count" "$drive_size_gb"
    printf '"ferrite_erasure_coding": "%s", ' "$erasure_coding"
    printf '"ferrite_up_args": %s, "ceph_osds": "%s x %s GiB", ' "$(jq -Rn --arg c "${FERRITE_UP_ARGS:-}" '$c')" \
        "$ceph_osd_count" "$osd_size_gb"
    printf '"disk_bound": %s, ' "$disk_bound_enabled"
    printf '"pgbench": %s, "pgbench_scale": %s, "pgbench_clients": %s, "pgbench_jobs": %s, "pgbench_time_s": %s, ' \
        "$pgbench_enabled" "$pgbench_scale" "$pgbench_clients" "$pgbench_jobs" "$pgbench_time_s"
    printf '"load_at_start": "%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
} >>"$results"

log "results -> $out"
log "fio: iodepth $iodepth x $numjobs jobs, ramp ${ramp_s} s + ${runtime_s} s per workload, image ${size_gb} GiB; load $(cut -d' ' -f1-3 /proc/loadavg)"

# ---------------------------------------------------------------- run
[ "$disk_bound_enabled" = 1 ] && disk_bound
for replicas in ${replica_counts//,/ }; do
    if ! has_side ferrite; then not_run ferrite "$replicas" "COMPARE_SIDES=$sides"; continue; fi
    if [ "$replicas" = 1 ]; then ferrite_single; else ferrite_replicated "$replicas"; fi
done

if has_side ceph; then
    ceph_up
    for replicas in ${replica_counts//,/ }; do
        if [ "$replicas" = 1 ]; then
            ceph_size1_pool
            ceph_measure 1 "$ceph_size1_pool" "$ceph_size1_image"
        else
            ceph_measure 3 "$anchor_pool" "$anchor_image"
        fi
    done
    ceph_cli df >"$out/logs/ceph-df.txt" 2>&1 || true
    log "disk: $(free_gb "$out") GiB free after the Ceph runs"
else
    for replicas in ${replica_counts//,/ }; do not_run ceph "$replicas" "COMPARE_SIDES=$sides"; done
fi

report_args=(--results "$results" --repo "$repo" --markdown "$out/report.md" --svg "$out/compare-ceph.svg")
[ "$write_docs" = 1 ] && report_args+=(--benchmarks-md docs/BENCHMARKS.md --docs-svg docs/compare-ceph.svg)
python3 scripts/compare-report.py "${report_args[@]}"
# What scripts/compare-medians.py needs of this run, in one small file that outlives $out: the
# results and the fio and pgbench outputs they name.
(cd "$out" && tar -cJf run.tar.xz results.jsonl fio $(ls logs/*-pgbench.log 2>/dev/null))
if [ "$write_docs" = 1 ]; then
    mkdir -p docs/compare-runs
    cp "$out/run.tar.xz" "docs/compare-runs/$(date -u -d "@$started_s" +%Y%m%dT%H%M%SZ).tar.xz"
fi
echo
cat "$out/report.md"
log "done in $(($(date +%s) - started_s)) s; raw results in $out (run.tar.xz for compare-medians.py)"
[ "$write_docs" = 1 ] && log "wrote docs/BENCHMARKS.md (compare-ceph section), docs/compare-ceph.svg and docs/compare-runs/"
exit 0
