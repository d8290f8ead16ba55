#!/usr/bin/env python3
"""Watch the block device that holds a path for stalls: intervals in which requests were in
flight at the device and none completed.

    scripts/disk-stall.py PATH [--interval-ms N]

Samples /sys/dev/block/MAJOR:MINOR/stat of the device holding PATH every N ms (50 by default)
until SIGTERM or SIGINT, then prints one JSON object and exits 0:

    {"disk": "vda", "interval_ms": 50, "samples": 612, "stall_max_ms": 310,
     "stalls_100ms": 2}

`stall_max_ms` is the longest time from the last sample at which the device made progress (an
I/O completed, or nothing was in flight) to a later sample at which it still had requests in
flight and had completed none since; `stalls_100ms` counts the stalls that reached 100 ms. The
resolution is the sampling interval. A path on no block device (tmpfs, overlay) gives
{"disk": null}. `make compare-ceph` runs it beside each fio workload, so a latency tail can be
told apart from a pause of the disk under both systems (on a virtual machine, the host's).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

STALL_COUNTED_MS = 100
# Fields of the stat file (Documentation/block/stat.rst): completed reads, writes, discards,
# flushes; and the requests in flight.
COMPLETED_FIELDS = (0, 4, 11, 15)
IN_FLIGHT_FIELD = 8


def stat_file(path):
    """The stat file of the block device holding `path`, and the device's name; None if none."""
    device = os.stat(path).st_dev
    major, minor = os.major(device), os.minor(device)
    if major == 0:
        return None
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    stat = sysfs / "stat"
    if not stat.exists():
        return None
    return stat, sysfs.resolve().name


def read_counters(stat):
    fields = [int(value) for value in stat.read_text().split()]
    completed = sum(fields[index] for index in COMPLETED_FIELDS if index < len(fields))
    return completed, fields[IN_FLIGHT_FIELD]


def main():
    args = sys.argv[1:]
    interval_ms = 50
    if len(args) == 3 and args[1] == "--interval-ms" and args[2].isdigit() and int(args[2]) > 0:
        interval_ms = int(args[2])
    elif len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(0 if args[:1] in (["-h"], ["--help"]) else 2)
    path = args[0]
    try:
        found = stat_file(path)
    except OSError as error:
        sys.exit(f"disk-stall: {path}: {error.strerror}")
    if found is None:
        print(json.dumps({"disk": None}))
        return
    stat, disk = found

    stopping = False

    def stop(_signal, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    samples, stall_max_s, stalls_counted = 0, 0.0, 0
    previous_completed, _ = read_counters(stat)
    last_progress = time.monotonic()
    counted = False  # the current stall already reached STALL_COUNTED_MS
    while not stopping:
        time.sleep(interval_ms / 1000)
        now = time.monotonic()
        completed, in_flight = read_counters(stat)
        samples += 1
        if completed != previous_completed or in_flight == 0:
            last_progress, counted = now, False
        else:
            stalled = now - last_progress
            stall_max_s = max(stall_max_s, stalled)
            if not counted and stalled * 1000 >= STALL_COUNTED_MS:
                stalls_counted, counted = stalls_counted + 1, True
        previous_completed = completed
    print(json.dumps({
        "disk": disk,
        "interval_ms": interval_ms,
        "samples": samples,
        "stall_max_ms": round(stall_max_s * 1000),
        "stalls_100ms": stalls_counted,
    }))


if __name__ == "__main__":
    main()
