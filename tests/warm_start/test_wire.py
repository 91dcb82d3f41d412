"""The warm-start request and reply format: anything on the socket is parsed or refused with our error."""

from __future__ import annotations

import os
import socket
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.warm_start.compatibility import cold_reason
from prime_node.warm_start.launcher import entry_of, fresh_sys_path
from prime_node.warm_start.wire import (
    MAX_REQUEST_BYTES,
    Request,
    WarmStartError,
    parse_reply,
    receive_request,
    reply_line,
    send_request,
    split_lines,
)

texts = st.text(max_size=40)


@given(
    argv=st.lists(texts, min_size=1, max_size=6),
    env=st.dictionaries(texts, texts, max_size=6),
    cwd=texts,
    sys_path=st.lists(texts, max_size=4),
)
def test_a_request_crosses_the_socket_with_its_three_descriptors(
    argv: list[str], env: dict[str, str], cwd: str, sys_path: list[str]
) -> None:
    ours, theirs = socket.socketpair()
    descriptors = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        sent = Request(
            "prime_node", tuple(argv), env, cwd, tuple(sys_path), "/usr/bin/python3", tuple(descriptors)
        )
        send_request(ours, sent)
        got = receive_request(theirs)
        assert (got.argv, dict(got.env), got.cwd, got.sys_path) == (sent.argv, env, cwd, sent.sys_path)
        assert len(got.fds) == 3 and all(os.fstat(fd) for fd in got.fds)
        for fd in got.fds:
            os.close(fd)
    finally:
        for fd in descriptors:
            os.close(fd)
        ours.close()
        theirs.close()


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        b'{"argv": []}',
        b'{"argv": ["x"], "env": {"a": 1}, "cwd": "/", "sys_path": []}',
    ],
)
def test_a_malformed_body_is_refused_and_its_descriptors_closed(body: bytes) -> None:
    ours, theirs = socket.socketpair()
    descriptor = os.open(os.devnull, os.O_RDONLY)
    try:
        socket.send_fds(ours, [len(body).to_bytes(4, "big")], [descriptor] * 3)
        ours.sendall(body)
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(WarmStartError):
            receive_request(theirs)
        assert len(os.listdir("/proc/self/fd")) <= before  # the three received copies were closed
    finally:
        os.close(descriptor)
        ours.close()
        theirs.close()


def test_an_oversized_or_descriptorless_request_is_refused_before_reading_it() -> None:
    for header, fds in (((MAX_REQUEST_BYTES + 1).to_bytes(4, "big"), 3), ((10).to_bytes(4, "big"), 0)):
        ours, theirs = socket.socketpair()
        descriptor = os.open(os.devnull, os.O_RDONLY)
        try:
            socket.send_fds(ours, [header], [descriptor] * fds)
            with pytest.raises(WarmStartError):
                receive_request(theirs)
        finally:
            os.close(descriptor)
            ours.close()
            theirs.close()


@given(st.binary(max_size=600))
def test_any_reply_bytes_parse_or_raise_our_error(data: bytes) -> None:
    buffer = bytearray(data)
    try:
        for line in split_lines(buffer):
            parse_reply(line)
    except WarmStartError:
        pass


@given(st.sampled_from(["pid", "exit"]), st.integers(-64, 1 << 22))
def test_replies_round_trip(kind: str, number: int) -> None:
    buffer = bytearray(reply_line(kind, number))
    (line,) = split_lines(buffer)
    assert parse_reply(line).kind == kind and parse_reply(line).number == number


def test_only_import_time_variables_and_the_python_decide_a_cold_start() -> None:
    base = {"HOME": "/root", "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert cold_reason(base, "/py", {**base, "HOME": "/tmp", "PRIME_NODE_X": "1"}, "/py") is None
    assert cold_reason(base, "/py", {**base, "PYTHONUNBUFFERED": "1"}, "/py") is None
    assert "OMP_NUM_THREADS" in (cold_reason(base, "/py", {**base, "OMP_NUM_THREADS": "2"}, "/py") or "")
    assert "ATEN_CPU_CAPABILITY" in (
        cold_reason(base, "/py", {**base, "ATEN_CPU_CAPABILITY": "default"}, "/py") or ""
    )
    assert "another Python" in (cold_reason(base, "/py", base, "/other/python") or "")


def test_only_prime_node_entry_points_are_warm_started() -> None:
    python = sys.executable
    assert entry_of([python, "-m", "prime_node", "join", "--x"]) == ("prime_node", ["join", "--x"])
    assert entry_of(["/usr/local/bin/prime-node", "status"]) == ("prime_node", ["status"])
    assert entry_of([python, "-m", "prime_node.ml.inference_worker", "--a"]) == (
        "prime_node.ml.inference_worker",
        ["--a"],
    )
    assert entry_of([python, "-m", "os"]) is None
    assert entry_of([python, "-c", "print(1)"]) is None
    assert entry_of(["/other/python", "-m", "prime_node"]) is None


def test_a_fresh_import_path_starts_with_the_directory_then_pythonpath() -> None:
    path = fresh_sys_path({"PYTHONPATH": "/extra/a:/extra/b"}, "/work/dir")
    assert path[:3] == ("/work/dir", "/extra/a", "/extra/b")
    assert set(sys.path[1:]) - set(os.environ.get("PYTHONPATH", "").split(os.pathsep)) <= set(path)
