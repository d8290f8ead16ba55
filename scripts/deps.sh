#!/usr/bin/env bash
# Installs the Debian packages the build, the test suite and benchmarks rely on, only if they are
# missing. Runs as root in CI (a fresh clone on a machine that may lack them); elsewhere it says
# what to do.
set -euo pipefail
needed=()
command -v fio >/dev/null 2>&1 || needed+=(fio)
# The build: the etcd client crate compiles etcd's gRPC definitions with protoc, which needs the
# protobuf well-known types (google/protobuf/descriptor.proto) from libprotobuf-dev.
command -v protoc >/dev/null 2>&1 || needed+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || needed+=(libprotobuf-dev)
# The metadata store's tests start their own etcd; etcdctl is for looking at a cluster's keys.
command -v etcd >/dev/null 2>&1 || needed+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || needed+=(etcd-client)
# The NBD frontend's tests run standard clients against it: nbdinfo, nbdcopy and nbdfuse
# (all in libnbd-bin), qemu-io and qemu-img (qemu-utils), and fusermount3 for nbdfuse (fuse3).
command -v nbdinfo >/dev/null 2>&1 || needed+=(libnbd-bin)
command -v qemu-io >/dev/null 2>&1 || needed+=(qemu-utils)
command -v fusermount3 >/dev/null 2>&1 || needed+=(fuse3)
# The database test (crates/cli/tests/pgbench.rs) and scripts/pgbench-ext4.sh run PostgreSQL on
# ext4 on a volume: initdb, pg_ctl, postgres and pgbench are in postgresql-15, which pulls in
# postgresql-client-15 (psql, pg_amcheck) and creates the `postgres` OS user they run as.
[ -x /usr/lib/postgresql/15/bin/pgbench ] || needed+=(postgresql-15)
# scripts/disk-stall.py (its test: crates/cli/tests/disk_stall.rs) and the compare-ceph report.
command -v python3 >/dev/null 2>&1 || needed+=(python3)
# `make compare-ceph` scrapes the cluster nodes' metrics with curl (scripts/write-stages.py).
command -v curl >/dev/null 2>&1 || needed+=(curl)
# The file system tests make ext4 on loop devices (mkfs.ext4, losetup, mount), and the cluster
# tests freeze one under a cluster (fsfreeze).
command -v mkfs.ext4 >/dev/null 2>&1 || needed+=(e2fsprogs)
command -v fsfreeze >/dev/null 2>&1 || needed+=(util-linux)
# The cluster tests (crates/cli/tests/cluster.rs) put nodes in network namespaces with `ip`.
command -v ip >/dev/null 2>&1 || needed+=(iproute2)
if [ ${#needed[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "deps: missing packages: ${needed[*]}; install them with: sudo apt-get install ${needed[*]}" >&2
    exit 1
fi
echo "deps: installing ${needed[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${needed[@]}" >/dev/null
