"""Plain TCP throughput between namespaces, to check the link shaping before trusting a broadcast on it.

    python tcp_probe.py recv HOST PORT SENDERS   # accept SENDERS connections, print one JSON line
    python tcp_probe.py send HOST PORT BYTES     # send BYTES, wait for the receiver's acknowledgement
    python tcp_probe.py mesh HOST PORT SENDERS BYTES [--store FILE] [TARGET_HOST:PORT ...]

The receiver times from the first byte of any connection to the last byte of all of them (bytes/s of
payload, i.e. after TCP/IP/Ethernet headers), so with several senders it measures the receiver's download.

``mesh`` is one peer of the plain-TCP baseline for the broadcast's CPU: it accepts SENDERS connections and
drains them, says ``ready``, waits for ``go`` on stdin, sends BYTES to each target at once, and says
``complete`` when it has sent everything and drained every sender. Sends and receives go through 1 MiB
buffers with ``sendall``/``recv_into``: about the least CPU a Python program can spend per byte moved.
With ``--store FILE`` it also writes what it receives into FILE (preallocated on ``go``, each sender's
bytes at their own offsets, one ``pwrite`` per read), as any receiver that keeps a checkpoint must: the
floor for moving and storing the bytes, which counts what the file system costs per byte written.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

CHUNK = 1 << 20
TIMEOUT = 60.0


def listen(host: str, port: int, backlog: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(max(1, backlog))
    server.settimeout(TIMEOUT)
    return server


def receive(host: str, port: int, senders: int) -> None:
    server = listen(host, port, senders)
    print(json.dumps({"event": "ready"}), flush=True)
    first: list[float] = []
    last: list[float] = []
    totals: list[int] = []
    lock = threading.Lock()

    def drain(conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT)
        buffer = bytearray(CHUNK)
        count = 0
        while True:
            got = conn.recv_into(buffer)
            now = time.perf_counter()
            if not got:
                break
            with lock:
                if not first:
                    first.append(now)
            count += got
        with lock:
            last.append(time.perf_counter())
            totals.append(count)
        conn.sendall(b"k")
        conn.close()

    threads = []
    for _ in range(senders):
        conn, _ = server.accept()
        thread = threading.Thread(target=drain, args=(conn,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(TIMEOUT)
    seconds = max(last) - first[0]
    print(json.dumps({"bytes": sum(totals), "seconds": seconds, "bytes_per_s": sum(totals) / seconds}))


def send(host: str, port: int, total: int) -> None:
    conn = socket.create_connection((host, port), timeout=TIMEOUT)
    data = b"\0" * CHUNK
    left = total
    while left:
        left -= conn.send(memoryview(data)[: min(CHUNK, left)])
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    conn.close()


def mesh(host: str, port: int, senders: int, total: int, targets: list[str], store: str | None) -> None:
    server = listen(host, port, senders)
    received: list[int] = []
    lock = threading.Lock()
    stored = threading.Event()  # set once the store file is open and preallocated
    store_fd = -1

    def drain(conn: socket.socket, slot: int) -> None:
        conn.settimeout(TIMEOUT)
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        count = 0
        while got := conn.recv_into(buffer):
            if store is not None:
                stored.wait(TIMEOUT)
                os.pwrite(store_fd, view[:got], slot * total + count)
            count += got
        with lock:
            received.append(count)
        conn.close()

    def accept_all() -> None:
        drains = []
        for slot in range(senders):
            conn, _ = server.accept()
            drains.append(threading.Thread(target=drain, args=(conn, slot)))
            drains[-1].start()
        for thread in drains:
            thread.join(TIMEOUT)

    def send_to(target: str) -> None:
        target_host, target_port = target.rsplit(":", 1)
        conn = socket.create_connection((target_host, int(target_port)), timeout=TIMEOUT)
        data = memoryview(bytes(CHUNK))
        left = total
        while left:
            step = min(CHUNK, left)
            conn.sendall(data[:step])
            left -= step
        conn.close()

    acceptor = threading.Thread(target=accept_all)
    acceptor.start()
    print(json.dumps({"event": "ready"}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    started = time.perf_counter()
    if store is not None:
        store_fd = os.open(store, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(store_fd, 0, senders * total)
        stored.set()
    sends = [threading.Thread(target=send_to, args=(target,)) for target in targets]
    for thread in sends:
        thread.start()
    for thread in [*sends, acceptor]:
        thread.join(TIMEOUT)
    seconds = time.perf_counter() - started
    if store is not None:
        os.close(store_fd)
    print(json.dumps({"event": "complete", "received": sum(received), "seconds": seconds}), flush=True)


if __name__ == "__main__":
    mode, host, port, value = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "mesh":
        rest = sys.argv[6:]
        store_file = rest[1] if rest[:1] == ["--store"] else None
        mesh(host, port, value, int(sys.argv[5]), rest[2:] if store_file else rest, store_file)
    else:
        receive(host, port, value) if mode == "recv" else send(host, port, value)
