"""``run-trainer`` across machines: the checked rendezvous flags, torchrun's command line and the ranks'
environment (pure; the two-namespace run is in test_trainer_multinode_netns.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.errors import NodeError
from prime_node.roles.rendezvous import (
    SINGLE_NODE,
    Rendezvous,
    gloo_interface,
    parse_rendezvous,
    split_endpoint,
    torchrun_command,
    torchrun_env,
)
from tests import warm_cli

REPO = Path(__file__).resolve().parents[2]
hosts = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,30}", fullmatch=True) | st.ip_addresses(v=4).map(str)


@given(host=hosts, port=st.integers(1, 65535))
def test_an_endpoint_splits_into_its_host_and_port(host: str, port: int) -> None:
    assert split_endpoint(f"{host}:{port}") == (host, port)


@given(address=st.ip_addresses(v=6), port=st.integers(1, 65535))
def test_an_ipv6_endpoint_is_bracketed(address: object, port: int) -> None:
    assert split_endpoint(f"[{address}]:{port}") == (str(address), port)


@given(text=st.text(max_size=40))
def test_any_endpoint_text_splits_or_is_refused_as_a_bad_flag(text: str) -> None:
    try:
        host, port = split_endpoint(text)
    except NodeError as exc:
        assert exc.reason == "bad_flag" and "--rdzv-endpoint" in str(exc)
    else:
        assert host and 1 <= port <= 65535


@pytest.mark.parametrize(
    ("nnodes", "node_rank", "endpoint", "says"),
    [
        (2, 2, "10.0.0.1:29400", "--node-rank 2: must be from 0 to --nnodes - 1 (1)"),
        (2, -1, "10.0.0.1:29400", "--node-rank -1"),
        (2, 0, None, "--nnodes 2 needs --rdzv-endpoint"),
        (1, 0, "10.0.0.1:29400", "--rdzv-endpoint is for --nnodes above 1"),
        (0, 0, None, "--nnodes 0"),
        (2, 1, "10.0.0.1", "expected HOST:PORT"),
        (2, 1, "10.0.0.1:0", "port must be 1-65535"),
        (2, 1, "fd00::1:29400", "expected HOST:PORT"),
    ],
)
def test_bad_combinations_are_refused(nnodes: int, node_rank: int, endpoint: str | None, says: str) -> None:
    with pytest.raises(NodeError) as caught:
        parse_rendezvous(nnodes, node_rank, endpoint)
    assert caught.value.reason == "bad_flag" and says in str(caught.value)


@given(nproc=st.integers(1, 8), nnodes=st.integers(2, 64), data=st.data())
def test_several_nodes_meet_by_the_static_rendezvous_in_node_rank_order(
    nproc: int, nnodes: int, data: st.DataObject
) -> None:
    node_rank = data.draw(st.integers(0, nnodes - 1))
    rendezvous = parse_rendezvous(nnodes, node_rank, "node0.example:29400")
    command = torchrun_command("pkg.mod", ["--x", "1"], nproc, rendezvous)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" not in command
    for flag in (
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=static",  # c10d would ignore --node-rank: rank 0 (the key) must be on node 0
        "--rdzv-endpoint=node0.example:29400",
        "--max-restarts=0",
        f"--nproc_per_node={nproc}",
    ):
        assert flag in command
    assert command[-4:] == ["-m", "pkg.mod", "--x", "1"]


def test_one_node_stays_standalone() -> None:
    command = torchrun_command("pkg.mod", [], 2)
    assert command == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "pkg.mod",
    ]
    assert torchrun_command("pkg.mod", [], 2, SINGLE_NODE) == command


def test_gloo_uses_loopback_on_one_node_and_the_given_interface_across_nodes() -> None:
    base = {"PATH": "/bin"}
    assert torchrun_env(environ=base, linux=True) == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    assert "GLOO_SOCKET_IFNAME" not in torchrun_env(environ=base, linux=False)
    mine = {**base, "GLOO_SOCKET_IFNAME": "eth1", "OMP_NUM_THREADS": "4"}
    assert torchrun_env(environ=mine, linux=True) == mine  # the user's settings win on one node
    assert torchrun_env("veth0", environ=mine, linux=True)["GLOO_SOCKET_IFNAME"] == "veth0"


def test_the_gloo_interface_is_the_flag_the_variable_or_the_one_towards_the_endpoint() -> None:
    assert gloo_interface(SINGLE_NODE, environ={}) is None
    assert gloo_interface(Rendezvous(interface="lo"), environ={"GLOO_SOCKET_IFNAME": "nope"}) == "lo"
    assert gloo_interface(SINGLE_NODE, environ={"GLOO_SOCKET_IFNAME": "lo"}) == "lo"
    # This machine reaches 127.0.0.1 from 127.0.0.1, which the loopback interface holds.
    assert gloo_interface(parse_rendezvous(2, 1, "127.0.0.1:29400"), environ={}) == "lo"
    with pytest.raises(NodeError, match="no network interface 'no-such-if0'"):
        gloo_interface(Rendezvous(interface="no-such-if0"), environ={})


def test_nodes_must_agree_on_the_run_but_not_on_its_paths(tmp_path: Path) -> None:
    from prime_node.config import load_run_config
    from prime_node.ml.distributed import run_digest

    config = tmp_path / "run.toml"
    config.write_text('run_id = "t"\nmax_steps = 3\n[task]\nkind = "math"\npath = "a.jsonl"\n')
    run = load_run_config(config)
    moved = {"output_dir": tmp_path / "o", "model_dir": tmp_path / "m", "trainer_address": "0x" + "1" * 40}
    assert run_digest(run.model_copy(update=moved)) == run_digest(run)
    assert run_digest(
        run.model_copy(update={"task": run.task.model_copy(update={"path": Path("b")})})
    ) == run_digest(run)
    assert run_digest(run.model_copy(update={"max_steps": 4})) != run_digest(run)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(
        [sys.executable, "-m", "prime_node", "run-trainer", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PRIME_NODE_KEYSTORE": ""},
        check=False,
    )


def test_the_cli_refuses_bad_multi_node_flags_before_anything_starts(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f'run_id = "t"\noutput_dir = "{tmp_path / "out"}"\n')
    for flags, says in [
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank 2"),
        (["--nnodes", "2"], "needs --rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1"], "expected HOST:PORT"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--gloo-interface", "no-such-if0"],
            "no network interface",
        ),
    ]:
        done = _cli("--config", str(config), "--local", *flags)
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("error:") and says in done.stderr, done.stderr
        assert done.stderr.strip().count("\n") == 0 and "torch" not in done.stderr
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_node_that_does_not_see_the_shared_output_directory_stops_every_node(tmp_path: Path) -> None:
    """Two nodes on loopback (``--local``): node 1's run config names another output directory, as on a
    machine without the shared storage; every rank stops before training, saying why."""
    from prime_node.assets import copy_demo_model

    copy_demo_model(tmp_path / "model")
    config = (
        f'run_id = "t"\nmodel_dir = "{tmp_path / "model"}"\noutput_dir = "{tmp_path / "shared"}"\n'
        "group_size = 4\nprompts_per_step = 4\nmax_new_tokens = 5\nmax_steps = 2\nthreads = 1\n"
        '[task]\nkind = "arithmetic"\n'
    )
    (tmp_path / "a.toml").write_text(config)
    (tmp_path / "b.toml").write_text(config.replace(str(tmp_path / "shared"), str(tmp_path / "local")))
    with socket.socket() as probe:  # a port nothing else on this machine listens on (tests run in parallel)
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    flags = ["--local", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        warm_cli.popen(
            [
                sys.executable,
                "-m",
                "prime_node",
                "run-trainer",
                "--config",
                str(tmp_path / f"{name}.toml"),
                *flags,
                "--node-rank",
                str(rank),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, name in enumerate("ab")
    ]
    try:
        outputs = [node.communicate(timeout=600) for node in nodes]  # a hang guard
    finally:
        for node in nodes:
            node.kill()
    errors = [[line for line in err.splitlines() if line.startswith("error:")] for _, err in outputs]
    assert [node.returncode for node in nodes] == [1, 1], outputs
    assert f"node 1 of 2: meeting at {endpoint}, gloo on lo" in outputs[1][1]
    assert errors[1][0].startswith(
        f"error: rank 1: it does not see rank 0's output directory at {tmp_path / 'local'}"
    )
    assert errors[0][0] == "error: another rank's run config or output directory differs (its error says how)"
    assert not (tmp_path / "local").exists() and list((tmp_path / "shared").iterdir()) == []
