"""Plain TCP throughput between namespaces, to check the link shaping before trusting a broadcast on it.

    python tcp_probe.py recv HOST PORT SENDERS   # accept SENDERS connections, print one JSON line
    python tcp_probe.py send HOST PORT BYTES     # send BYTES, wait for the receiver's acknowledgement

The receiver times from the first byte of any connection to the last byte of all of them (bytes/s of
payload, i.e. after TCP/IP/Ethernet headers), so with several senders it measures the receiver's download.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

CHUNK = 1 << 20
TIMEOUT = 60.0


def receive(host: str, port: int, senders: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(senders)
    server.settimeout(TIMEOUT)
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


if __name__ == "__main__":
    mode, host, port, value = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    receive(host, port, value) if mode == "recv" else send(host, port, value)
