#!/usr/bin/env python3
"""The floor under any NVMe/TCP QD1 latency on this machine: the round trip of a 4 KiB read's
bytes over TCP loopback with nothing else in the way.

A server pinned to one CPU answers each 72-byte request (a capsule's size) with 4,120 bytes (a
4 KiB C2HData PDU and a response capsule); a client pinned to another CPU sends one request at a
time. Prints the mean and median round trip in microseconds. With both on one CPU the wake-ups
stay on that CPU; across CPUs each message wakes a sleeping vCPU, which in a VM is what costs.

    scripts/tcp-rtt.py [--server-cpu 0] [--client-cpu 1] [--count 20000]
"""

import argparse
import os
import socket
import statistics
import sys
import time

REQUEST_BYTES = 72
RESPONSE_BYTES = 4096 + 24


def serve(listener: socket.socket, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    response = b"r" * RESPONSE_BYTES
    while True:
        got = 0
        while got < REQUEST_BYTES:
            chunk = connection.recv(REQUEST_BYTES - got)
            if not chunk:
                return
            got += len(chunk)
        connection.sendall(response)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--client-cpu", type=int, default=1)
    parser.add_argument("--count", type=int, default=20000)
    args = parser.parse_args()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    child = os.fork()
    if child == 0:
        try:
            serve(listener, args.server_cpu)
        finally:
            os._exit(0)
    listener.close()
    os.sched_setaffinity(0, {args.client_cpu})
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = b"q" * REQUEST_BYTES
    samples = []
    for _ in range(args.count):
        start = time.perf_counter_ns()
        client.sendall(request)
        got = 0
        while got < RESPONSE_BYTES:
            chunk = client.recv(65536)
            if not chunk:
                print("the server closed the connection", file=sys.stderr)
                return 1
            got += len(chunk)
        samples.append(time.perf_counter_ns() - start)
    client.close()
    os.waitpid(child, 0)
    warm = samples[len(samples) // 10 :]
    print(
        f"tcp rtt cpu{args.client_cpu}->cpu{args.server_cpu}: "
        f"mean {statistics.fmean(warm) / 1000:.1f} us, "
        f"median {statistics.median(warm) / 1000:.1f} us ({len(warm)} round trips)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
