#!/usr/bin/env bash
# PostgreSQL's pgbench on ext4 on any block device, to compare block storage systems on a
# database load: makes ext4 on DEVICE (destroying what it holds), mounts it on MOUNTPOINT,
# creates a PostgreSQL cluster there (initdb as the `postgres` OS user), loads it with
# `pgbench -i -s SCALE`, runs `pgbench -c CLIENTS -j JOBS -T SECONDS` and prints its latency and
# TPS lines; then stops PostgreSQL and unmounts, also on failure. It knows nothing of the storage
# behind DEVICE: a loop device over an nbdfuse file of a Ferrite volume, an rbd-fuse image, a
# kernel NBD or RBD device all do.
#
#   scripts/pgbench-ext4.sh [--scale N] [--clients N] [--jobs N] [--time SECONDS] DEVICE MOUNTPOINT
#
# Needs root (mkfs, mount, runuser) and the Debian package postgresql-15 (scripts/deps.sh);
# PG_BIN=/usr/lib/postgresql/VERSION/bin picks another installation. PostgreSQL listens on a
# unix socket in a temp dir only (no TCP port), so it cannot clash with another server.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/pgbench-ext4.sh [OPTIONS] DEVICE MOUNTPOINT

Runs PostgreSQL's pgbench on a fresh ext4 file system on DEVICE and prints its latency and TPS.

  1. mkfs.ext4 DEVICE (everything on DEVICE is lost) and mount it on MOUNTPOINT
     (created if missing; it must not be a mountpoint already)
  2. initdb MOUNTPOINT/pgdata as the `postgres` OS user; start PostgreSQL with its socket
     in a temp dir and no TCP listener
  3. pgbench -i -s SCALE, then pgbench -c CLIENTS -j JOBS -T SECONDS (TPC-B-like load)
  4. print the "latency average" and "tps" lines, stop PostgreSQL, unmount

Options:
  --scale N        pgbench scale factor, 100 000 accounts (about 15 MiB) each [default 10]
  --clients N      concurrent database sessions [default 4]
  --jobs N         pgbench worker threads [default 2]
  --time SECONDS   length of the measured run [default 30]
  -h, --help       this text

Environment:
  PG_BIN           PostgreSQL's bin directory [default: the newest /usr/lib/postgresql/*/bin]

Needs root and the Debian package postgresql-15 (scripts/deps.sh installs it). Example, on a
Ferrite volume exported over NBD:
  nbdfuse /tmp/fuse/vol nbd://127.0.0.1:10809/vol &
  dev=$(losetup --find --show --sector-size 4096 /tmp/fuse/vol)
  scripts/pgbench-ext4.sh --time 60 "$dev" /mnt/pgbench
  losetup -d "$dev"; fusermount3 -u /tmp/fuse
EOF
}

scale=10
clients=4
jobs=2
seconds=30
positional=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --scale) scale=${2:?--scale needs a number}; shift 2 ;;
        --clients) clients=${2:?--clients needs a number}; shift 2 ;;
        --jobs) jobs=${2:?--jobs needs a number}; shift 2 ;;
        --time) seconds=${2:?--time needs a number of seconds}; shift 2 ;;
        --) shift; positional+=("$@"); break ;;
        -*) echo "pgbench-ext4: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) positional+=("$1"); shift ;;
    esac
done
if [ ${#positional[@]} -ne 2 ]; then
    echo "pgbench-ext4: expected DEVICE and MOUNTPOINT (see --help)" >&2
    exit 2
fi
device=${positional[0]}
mountpoint=${positional[1]}
for value in "$scale" "$clients" "$jobs" "$seconds"; do
    [[ "$value" =~ ^[1-9][0-9]*$ ]] || { echo "pgbench-ext4: $value is not a positive number" >&2; exit 2; }
done
fail() { echo "pgbench-ext4: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || fail "needs root (mkfs, mount, runuser)"
[ -b "$device" ] || fail "$device is not a block device"
findmnt --source "$device" >/dev/null 2>&1 && fail "$device is mounted; unmount it first"
if [ -z "${PG_BIN:-}" ]; then
    PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
fi
[ -n "$PG_BIN" ] && [ -x "$PG_BIN/pgbench" ] ||
    fail "PostgreSQL is not installed: apt-get install postgresql-15 (or set PG_BIN)"
id postgres >/dev/null 2>&1 || fail "there is no postgres OS user (the postgresql-15 package creates it)"
mkdir -p "$mountpoint"
mountpoint -q "$mountpoint" && fail "$mountpoint is already a mountpoint"

run_dir=$(mktemp -d "${TMPDIR:-/tmp}/pgbench-ext4.XXXXXX")
chmod 755 "$run_dir"
chown postgres: "$run_dir"
pgdata=$mountpoint/pgdata
mounted=0
started=0
cleanup() {
    if [ "$started" -eq 1 ]; then
        as_postgres "$PG_BIN/pg_ctl" stop -w -m fast -D "$pgdata" >/dev/null ||
            as_postgres "$PG_BIN/pg_ctl" stop -w -m immediate -D "$pgdata" >/dev/null || true
    fi
    if [ "$mounted" -eq 1 ]; then
        umount "$mountpoint" || echo "pgbench-ext4: could not unmount $mountpoint" >&2
    fi
    rm -rf "$run_dir"
}
trap cleanup EXIT
as_postgres() { (cd "$run_dir" && runuser -u postgres -- "$@"); }
client() { as_postgres "$PG_BIN/$1" -h "$run_dir" "${@:2}"; }

echo "pgbench-ext4: ext4 on $device, mounted on $mountpoint"
mkfs.ext4 -q -F "$device"
mount "$device" "$mountpoint"
mounted=1
mkdir "$pgdata"
chown postgres: "$pgdata"
as_postgres test -w "$pgdata" || fail "the postgres user cannot reach $pgdata (check the modes of its parents)"
as_postgres "$PG_BIN/initdb" -D "$pgdata" -A trust -E UTF8 --locale=C >"$run_dir/initdb.log" 2>&1 ||
    { cat "$run_dir/initdb.log" >&2; fail "initdb failed"; }
cat >>"$pgdata/postgresql.conf" <<EOF

# Set by scripts/pgbench-ext4.sh: a unix socket in a private directory, no TCP listener.
listen_addresses = ''
unix_socket_directories = '$run_dir'
EOF
as_postgres "$PG_BIN/pg_ctl" start -w -D "$pgdata" -l "$run_dir/server.log" >/dev/null ||
    { cat "$run_dir/server.log" >&2; fail "PostgreSQL did not start"; }
started=1

echo "pgbench-ext4: pgbench -i -s $scale"
load_begin=$(date +%s%N)
client pgbench -i -q -s "$scale" postgres >"$run_dir/init.log" 2>&1 ||
    { cat "$run_dir/init.log" >&2; fail "pgbench -i failed"; }
load_end=$(date +%s%N)
echo "pgbench-ext4: loaded in $(((load_end - load_begin) / 1000000)) ms"

echo "pgbench-ext4: pgbench -c $clients -j $jobs -T $seconds"
client pgbench -n -c "$clients" -j "$jobs" -T "$seconds" postgres >"$run_dir/run.log" 2>&1 ||
    { cat "$run_dir/run.log" >&2; fail "pgbench failed"; }
grep -E '^(number of transactions actually processed:|latency average =|latency stddev =|tps =)' "$run_dir/run.log"
