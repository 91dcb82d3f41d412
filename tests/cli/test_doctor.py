"""``prime-node doctor``: each check from injected facts, the report and its exit code, and the real thing
(a ``prime-node join`` process probed over libp2p on 127.0.0.1 by a ``prime-node doctor`` process)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.doctor.machine import MIN_RAM_MIB, check_disk, check_gpu, check_ram
from prime_node.doctor.model_size import DEFAULT_PARAMS, JOIN_KEEP, default_estimate, estimate
from prime_node.doctor.network import (
    MAX_SKEW_MS,
    NetworkFacts,
    PeerProbe,
    ReachabilityFact,
    check_bandwidth,
    check_bootstrap,
    check_clock,
    check_reachability,
)
from prime_node.doctor.probes import Transfer, probe_clock, probe_download, probe_upload
from prime_node.doctor.report import Check, Report
from prime_node.doctor.role import check_role
from prime_node.doctor.software import (
    CPU_TORCH_PIN,
    TORCH_MIN,
    SoftwareFacts,
    check_python,
    check_torch,
    gather_software,
    parse_smi_banner,
    parse_torch_cuda,
)
from prime_node.errors import NodeError
from prime_node.node.clock import NodeClock
from prime_node.node.probe_service import ProbeRefusedError, ProbeService
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.warm_start.process import WarmProcess
from protocol.codec import decode, encode
from protocol.probe import (
    BUSY,
    DOWNLOAD,
    MALFORMED,
    MAX_PROBE_BYTES,
    PROBE_PROTOCOL,
    RATE_LIMITED,
    UPLOAD,
    ClockEstimate,
    ProbeChunk,
    ProbeLimits,
    ProbeReady,
    ProbeRefused,
    ProbeRequest,
)
from protocol.resources import GpuInfo, HardwareProfile
from tests import warm_cli
from tests.p2p.helpers import make_config, start_node

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "prime_node" / "assets" / "tiny_arithmetic"
CPU_BOX = HardwareProfile((), 2, 16 << 10, 100 << 10)
H100 = HardwareProfile((GpuInfo(0, "H100", 81559, (9, 0)),), 16, 128 << 10, 500 << 10, "nvml")
CPU_TORCH = SoftwareFacts((3, 11, 7), "/venv/bin/python", "2.13.0+cpu", None, gpu_count=0)
PEER = "16Uiu2HAkx8UxNNsxLEMG815d7qtd3osJgJrw1ZL1EFthkNDvBXaL"
ADDR = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"


# -- software ----------------------------------------------------------------------------------------------


def test_the_pins_match_pyproject_and_the_install_script() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={TORCH_MIN[0]}.{TORCH_MIN[1]}"' in pyproject
    assert 'requires-python = ">=3.11"' in pyproject
    assert f'torch_requirement="torch=={CPU_TORCH_PIN}"' in (ROOT / "scripts" / "install.sh").read_text()


def test_python_older_than_311_fails_with_a_fix() -> None:
    assert check_python(CPU_TORCH).status == "pass"
    old = check_python(dataclasses.replace(CPU_TORCH, python=(3, 10, 12)))
    assert old.status == "fail" and "3.11" in (old.fix or "")


def test_cpu_torch_on_a_cpu_machine_passes_with_a_clear_value() -> None:
    check = check_torch(CPU_TORCH)
    assert check.status == "pass"
    assert "CPU build" in check.value and "2.13.0" in check.value


@pytest.mark.parametrize(
    ("changes", "status", "in_value", "in_fix"),
    [
        ({"torch_version": None}, "fail", "not installed", "install.sh"),
        ({"torch_version": "2.1.0+cpu"}, "fail", "older than 2.4", "install.sh"),
        ({"torch_version": "2.9.1+cpu"}, "warn", "differs from the pinned 2.13.0", "torch==2.13.0"),
        ({"torch_cuda": "12.4"}, "warn", "no NVIDIA GPU", "torch==2.13.0"),
        ({"gpu_count": 1}, "fail", "CPU build but this machine has 1 NVIDIA GPU", "--gpu none"),
        (
            {"gpu_count": 1, "torch_cuda": "13.0", "driver_version": "535.1", "driver_cuda": "12.2"},
            "fail",
            "needs CUDA 13.0",
            "update the NVIDIA driver",
        ),
        (
            {"gpu_count": 1, "torch_cuda": "12.8", "driver_version": "535.1", "driver_cuda": "12.2"},
            "warn",
            "newer than the driver",
            "update the NVIDIA driver",
        ),
        (
            {"gpu_count": 1, "torch_cuda": "12.4", "driver_cuda": "12.4", "cuda_usable": False},
            "fail",
            "cannot use the GPU",
            "nvidia-smi",
        ),
    ],
)
def test_torch_builds_that_do_not_fit_the_machine(
    changes: dict[str, object], status: str, in_value: str, in_fix: str
) -> None:
    check = check_torch(dataclasses.replace(CPU_TORCH, **changes))  # type: ignore[arg-type]
    assert check.status == status
    assert in_value in check.value
    assert in_fix in (check.fix or "")


def test_a_cuda_build_the_driver_supports_passes() -> None:
    facts = dataclasses.replace(
        CPU_TORCH,
        torch_version="2.6.0+cu124",
        torch_cuda="12.4",
        gpu_count=1,
        driver_version="550.54",
        driver_cuda="12.4",
        cuda_usable=True,
    )
    check = check_torch(facts)
    assert check.status == "pass" and "CUDA 12.4 build" in check.value and "550.54" in check.value


def test_torch_and_driver_facts_are_read_without_importing_torch() -> None:
    assert parse_torch_cuda("__version__ = '2.6.0+cu124'\ncuda: Optional[str] = '12.4'\n") == "12.4"
    assert parse_torch_cuda("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n") is None
    banner = "| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4     |"
    assert parse_smi_banner(banner) == ("550.54.15", "12.4")
    assert parse_smi_banner("NVIDIA-SMI has failed because it couldn't communicate") == (None, None)
    here = gather_software(0)  # this machine: whatever torch is installed, its build matches its version tag
    if here.torch_version is not None and "+cpu" in here.torch_version:
        assert here.torch_cuda is None
    assert here.driver_cuda is None and here.cuda_usable is None  # not asked without a GPU


# -- machine, model, role -----------------------------------------------------------------------------------


def test_no_gpu_passes_and_says_what_the_node_can_still_do() -> None:
    check = check_gpu(CPU_BOX, default_estimate())
    assert check.status == "pass" and "CPU only" in check.value and check.details["gpus"] == []


def test_a_gpu_too_small_for_the_model_warns() -> None:
    small = HardwareProfile((GpuInfo(0, "GTX 1050", 2048, (6, 1)),), 4, 16 << 10, 100 << 10, "nvml")
    check = check_gpu(small, default_estimate())
    assert check.status == "warn" and "too small" in check.value
    assert check_gpu(H100, default_estimate()).status == "pass"


def test_ram_below_the_minimum_fails() -> None:
    assert check_ram(CPU_BOX).status == "pass"
    low = check_ram(dataclasses.replace(CPU_BOX, ram_mib=MIN_RAM_MIB - 1))
    assert low.status == "fail" and low.fix


def test_disk_must_hold_k_plus_one_checkpoints() -> None:
    model = default_estimate()
    needed_mib = (JOIN_KEEP + 1) * DEFAULT_PARAMS * 2 / (1 << 20)
    assert model.disk_needed_bytes == (JOIN_KEEP + 1) * DEFAULT_PARAMS * 2
    enough = check_disk(dataclasses.replace(CPU_BOX, disk_free_mib=int(needed_mib) + 1), model, "/data")
    assert enough.status == "pass" and enough.details["keep"] == JOIN_KEEP
    short = check_disk(dataclasses.replace(CPU_BOX, disk_free_mib=int(needed_mib) - 1), model, "/data")
    assert short.status == "fail" and "--data-dir" in (short.fix or "")


def test_the_model_comes_from_a_directory_or_a_run_config(tmp_path: Path) -> None:
    tiny = estimate(TINY_MODEL, None)
    assert tiny.source.endswith(str(TINY_MODEL)) and 0 < tiny.checkpoint_bytes < 5 << 20
    assert tiny.requirements.cpu_ok
    config = tmp_path / "run.toml"
    config.write_text(f'model_dir = "{TINY_MODEL}"\nasync_level = 5\n')
    from_config = estimate(None, config)
    assert from_config.keep == 6 and from_config.checkpoint_bytes == tiny.checkpoint_bytes
    assert estimate(None, None).keep == JOIN_KEEP and "default estimate" in estimate(None, None).source
    with pytest.raises(NodeError):
        estimate(tmp_path / "missing", None)


def test_the_role_and_why() -> None:
    tiny = estimate(TINY_MODEL, None)
    assert check_role(CPU_BOX, tiny).details["role"] == "inferer"
    validator = check_role(CPU_BOX, default_estimate())
    assert validator.status == "pass" and validator.value.startswith("validator: CPU")
    starved = check_role(dataclasses.replace(CPU_BOX, ram_mib=1024), default_estimate())
    assert starved.status == "warn" and starved.details["role"] == "seeder" and starved.fix
    assert check_role(H100, default_estimate()).details["role"] == "inferer"
    pinned = check_role(CPU_BOX, tiny, "trainer")
    assert pinned.status == "fail" and "trainer key" in pinned.value


# -- network checks from injected facts ---------------------------------------------------------------------


def _reached(**changes: object) -> PeerProbe:
    probe = PeerProbe(
        ADDR,
        peer_id=PEER,
        dial_ms=12.0,
        clock=ClockEstimate(skew_ms=4, rtt_ms=2),
        download=Transfer(1 << 20, 0.05),
        upload=Transfer(1 << 20, 0.1),
    )
    return dataclasses.replace(probe, **changes)  # type: ignore[arg-type]


def test_without_bootstrap_the_network_checks_are_skipped_with_how_to_give_one() -> None:
    facts = NetworkFacts(given=False)
    checks = [
        check_bootstrap(facts),
        check_reachability(facts),
        check_clock(facts),
        check_bandwidth(facts, default_estimate()),
    ]
    assert [c.status for c in checks] == ["skip"] * 4
    assert "--bootstrap /ip4/" in (checks[0].fix or "")
    assert Report(tuple(checks)).exit_code == 0


def test_a_reachable_bootstrap_reports_its_latency() -> None:
    check = check_bootstrap(NetworkFacts(given=True, peers=[_reached()]))
    assert check.status == "pass" and "1/1 reachable" in check.value
    assert check.details["peers"][0]["latency_ms"] == 2.0  # the probe's round trip, not the dial
    no_probe = check_bootstrap(NetworkFacts(given=True, peers=[_reached(clock=None)]))
    assert no_probe.details["peers"][0]["latency_ms"] == 12.0


@pytest.mark.parametrize(
    ("probe", "in_fix"),
    [
        (PeerProbe("garbage", error="bad multiaddr", reason="bad_multiaddr"), "/p2p/<peer id>"),
        (PeerProbe(ADDR, error="cannot reach", reason="dial_failed"), "ufw allow"),
    ],
)
def test_a_bad_or_unreachable_bootstrap_fails_with_a_fix(probe: PeerProbe, in_fix: str) -> None:
    facts = NetworkFacts(given=True, peers=[_reached(), probe])
    check = check_bootstrap(facts)
    assert check.status == "fail" and "1/2 reachable" in check.value and in_fix in (check.fix or "")
    assert Report((check,)).exit_code == 1


@pytest.mark.parametrize(
    ("skew_ms", "status"),
    [
        (4, "pass"),
        (-1_500, "pass"),
        (5_000, "warn"),
        (-(MAX_SKEW_MS + 10_000), "fail"),
        (MAX_SKEW_MS + 5_000, "fail"),
    ],
)
def test_clock_skew_against_the_envelope_window(skew_ms: int, status: str) -> None:
    facts = NetworkFacts(given=True, peers=[_reached(clock=ClockEstimate(skew_ms, 20))])
    check = check_clock(facts)
    assert check.status == status and check.details["skew_ms"] == skew_ms
    if status != "pass":
        assert "timedatectl" in (check.fix or "")


def test_a_peer_that_does_not_answer_probes_warns_instead_of_failing() -> None:
    facts = NetworkFacts(
        given=True, peers=[_reached(clock=None, download=None, upload=None, probe_error="no probe")]
    )
    assert check_clock(facts).status == "warn"
    assert check_bandwidth(facts, default_estimate()).status == "warn"


def test_bandwidth_reports_rates_and_warns_when_a_checkpoint_would_take_hours() -> None:
    fast = check_bandwidth(NetworkFacts(given=True, peers=[_reached()]), default_estimate())
    assert fast.status == "pass"
    assert fast.details["download_bytes_per_s"] == round((1 << 20) / 0.05)
    slow_peer = _reached(download=Transfer(1 << 20, 10.0))
    slow = check_bandwidth(NetworkFacts(given=True, peers=[slow_peer]), default_estimate())
    assert slow.status == "warn" and slow.details["checkpoint_fetch_s"] > 3600


@pytest.mark.parametrize(
    ("status", "expected", "in_fix"),
    [("public", "pass", None), ("private", "warn", "--announce"), ("unknown", "warn", "--announce")],
)
def test_reachability(status: str, expected: str, in_fix: str | None) -> None:
    facts = NetworkFacts(given=True, peers=[_reached()], reachability=ReachabilityFact(status, "why"))
    check = check_reachability(facts)
    assert check.status == expected and check.details["reachability"] == status
    if in_fix:
        assert in_fix in (check.fix or "")


# -- the report ----------------------------------------------------------------------------------------------


def test_warnings_do_not_fail_and_every_failure_has_a_fix_line() -> None:
    warn = Check("a", "warn", "hmm", "do this")
    fail = Check("b", "fail", "broken", "fix that")
    assert Report((warn,)).exit_code == 0
    report = Report((warn, fail), 1.0)
    assert report.exit_code == 1
    assert report.to_json()["checks"]["b"] == {"status": "fail", "value": "broken", "fix": "fix that"}
    assert any(line.strip() == "fix: fix that" for line in report.lines())
    with pytest.raises(ValueError, match="fix line"):
        Check("c", "fail", "broken")


# -- the probe service on a real libp2p node, against honest and hostile requesters -------------------------

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


async def test_the_probe_service_answers_honest_probes_and_refuses_hostile_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prime_node.node.probe_service")
    service = ProbeService(ProbeLimits(requests_per_window=8))
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(
            nursery,
            OPEN,
            make_config(tmp_path, 0),
            services=[service],
            write_node_file=False,
            serve_api=False,
        )
        async with open_libp2p_host(WalletKey.generate(), "/ip4/127.0.0.1/tcp/0") as client:
            peer = await client.connect(node.advertised_multiaddrs()[0])
            with trio.fail_after(30):
                clock = await probe_clock(client, peer, NodeClock().wall_ms)  # 3 requests
                assert abs(clock.skew_ms) <= clock.rtt_ms / 2 + 1000
                assert (await probe_download(client, peer, 300_000)).bytes == 300_000
                assert (await probe_upload(client, peer, 300_001)).bytes == 300_001

                async def ask(*frames: bytes) -> ProbeRefused:
                    stream = await client.open_stream(peer, PROBE_PROTOCOL)
                    for frame in frames:
                        await stream.send_frame(frame)
                    answer = await stream.receive_frame()
                    assert answer is not None
                    if frames and frames[0] == encode(ProbeRequest(UPLOAD, 10)):
                        assert decode(answer, ProbeReady) == ProbeReady()
                        answer = await stream.receive_frame()
                        assert answer is not None
                    return decode(answer, ProbeRefused)

                assert (await ask(b"\x93junk")).reason == MALFORMED  # not a request
                assert (await ask(b"x" * 4096)).reason == MALFORMED  # a frame far over the request cap
                over = encode(ProbeRequest(UPLOAD, 10))
                assert (
                    await ask(over, encode(ProbeChunk(b"y" * 11)))
                ).reason == MALFORMED  # more than announced

                # A download the requester does not read stays in flight: a second probe is refused (busy).
                held = await client.open_stream(peer, PROBE_PROTOCOL)
                await held.send_frame(encode(ProbeRequest(DOWNLOAD, MAX_PROBE_BYTES)))
                await trio.sleep(0.5)
                with pytest.raises(ProbeRefusedError) as busy:
                    await probe_clock(client, peer, NodeClock().wall_ms, rounds=1)
                assert busy.value.reason == BUSY
                await held.reset()
                await trio.sleep(0.5)
                # Admitted so far: 3 time, 2 transfers, the bad upload, the held download (8 per minute).
                with pytest.raises(ProbeRefusedError) as limited:
                    await probe_clock(client, peer, NodeClock().wall_ms, rounds=3)
                assert limited.value.reason == RATE_LIMITED
        assert service.served == {"time": 4, "download": 1, "upload": 1}  # 3 + the one before the limit
        assert service.refused[MALFORMED] == 3 and service.refused[BUSY] == 1
        assert service.refused[RATE_LIMITED] >= 1
        assert node.metrics.counters["offence_malformed"] == 3
        assert "refused" in caplog.text and "probe_malformed" in caplog.text
        nursery.cancel_scope.cancel()


# -- the real thing ------------------------------------------------------------------------------------------

CLI = [sys.executable, "-m", "prime_node"]
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")},
    "PRIME_NODE_LOG_LEVEL": "warning",
}


def _doctor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(
        [*CLI, "doctor", "--listen", "/ip4/127.0.0.1/tcp/0", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        check=False,
    )


def test_doctor_without_bootstrap_passes_on_this_machine(tmp_path: Path) -> None:
    done = _doctor("--data-dir", str(tmp_path), "--model", str(TINY_MODEL), "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    checks = report["checks"]
    for name in ("python", "torch", "gpu", "ram", "model", "disk", "role"):
        assert checks[name]["status"] in ("pass", "warn"), checks[name]
    for name in ("bootstrap", "reachability", "clock", "bandwidth"):
        assert checks[name]["status"] == "skip" and checks[name]["fix"]


def test_an_unreachable_bootstrap_fails_with_its_fix_line(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = _doctor(
        "--data-dir", str(tmp_path), "--timeout", "3", "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER}"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    failed = next(i for i, line in enumerate(lines) if line.startswith("FAIL") and "bootstrap" in line)
    assert "0/1 reachable" in lines[failed] and "unreachable" in lines[failed]
    assert lines[failed + 1].strip().startswith("fix: check that the node at")
    bad = _doctor("--data-dir", str(tmp_path), "--json", "--bootstrap", "/ip4/127.0.0.1/tcp/4001")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    check = json.loads(bad.stdout)["checks"]["bootstrap"]
    assert check["status"] == "fail" and check["peers"][0]["reason"] == "bad_multiaddr" and check["fix"]


def _wait_for_node_file(
    data_dir: Path, process: subprocess.Popen[Any] | WarmProcess, timeout: float = 60
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = data_dir / "node.json"
        if path.exists():
            document = json.loads(path.read_text())
            if document["state"] == "running":
                return dict(document)
        assert process.poll() is None, process.communicate()[1]
        time.sleep(0.2)
    raise AssertionError("node.json never appeared")


@pytest.mark.slow
def test_doctor_probes_a_running_node(tmp_path: Path) -> None:
    node = warm_cli.popen(
        [
            *CLI,
            "join",
            "--data-dir",
            str(tmp_path / "node"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--run",
            "doctortest",
            "--new-wallet",
            "--no-password",
            "--light-kdf",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        document = _wait_for_node_file(tmp_path / "node", node)
        multiaddr = str(document["multiaddrs"][0])  # type: ignore[index]
        started = time.monotonic()
        done = _doctor(
            "--data-dir", str(tmp_path), "--json", "--model", str(TINY_MODEL), "--bootstrap", multiaddr
        )
        elapsed = time.monotonic() - started
        report = json.loads(done.stdout)
        checks = report["checks"]
        assert checks["bootstrap"]["status"] == "pass", checks["bootstrap"]
        (peer,) = checks["bootstrap"]["peers"]
        assert peer["reachable"] and peer["peer_id"] == document["peer_id"] and peer["latency_ms"] >= 0
        assert checks["clock"]["status"] == "pass"
        # Both clocks are this machine's: what is left is the measurement's own error.
        assert abs(checks["clock"]["skew_ms"]) <= checks["clock"]["uncertainty_ms"] + 1000
        assert (
            checks["bandwidth"]["download_bytes_per_s"] > 0 and checks["bandwidth"]["upload_bytes_per_s"] > 0
        )
        assert checks["bandwidth"]["probe_bytes"] == 1 << 20
        assert checks["reachability"]["status"] in ("pass", "warn")
        assert done.returncode == (1 if report["failed"] else 0)
        assert report["failed"] == [], report["failed"]
        print(f"doctor against a join process: {elapsed:.1f} s, {json.dumps(checks['bandwidth'])}")
    finally:
        node.terminate()
        node.wait(timeout=20)
    _, stderr = node.communicate()
    assert "Traceback" not in stderr
