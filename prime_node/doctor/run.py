"""Gather the facts and run every check, in the order a person reads them: software, machine, role and
its device (with the VRAM plan), then the network (which needs ``--bootstrap``)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from prime_node.config.run import RunConfig, load_run_config
from prime_node.doctor.device import check_device
from prime_node.doctor.machine import check_disk, check_gpu, check_ram
from prime_node.doctor.model_size import ModelEstimate, default_estimate, estimate
from prime_node.doctor.network import (
    check_bandwidth,
    check_bootstrap,
    check_clock,
    check_reachability,
    gather_network,
)
from prime_node.doctor.report import FAIL, PASS, Check, Report
from prime_node.doctor.role import check_role
from prime_node.doctor.software import check_python, check_torch, gather_software
from prime_node.errors import NodeError
from prime_node.hardware import parse_gpu_selection, probe


@dataclass(frozen=True)
class DoctorOptions:
    bootstrap: tuple[str, ...] = ()
    listen: str = "/ip4/0.0.0.0/tcp/0"
    data_dir: Path = Path()
    model_dir: Path | None = None
    run_config: Path | None = None
    gpus: str = "auto"
    role: str | None = None
    timeout: float = 5.0
    """Seconds each network step (dial, each probe, the reachability probe) may take."""
    probe_bytes: int = 1 << 20


def _model(options: DoctorOptions) -> tuple[ModelEstimate, Check]:
    try:
        model = estimate(options.model_dir, options.run_config)
    except NodeError as exc:
        model = default_estimate()
        fix = (
            "pass --model a Hugging Face model directory (config.json, *.safetensors) or a valid --run-config"
        )
        return model, Check("model", FAIL, f"{exc}; using the {model.source}", fix)
    details = {"checkpoint_bytes": model.checkpoint_bytes, "keep": model.keep, "source": model.source}
    return model, Check("model", PASS, model.source, None, details)


def _run_and_model_dir(options: DoctorOptions) -> tuple[RunConfig, Path | None]:
    """The run config (defaults without --run-config, or when it does not load: ``model`` reports that)
    and the model directory, for the device check's VRAM plan."""
    run = RunConfig.model_validate({})
    if options.run_config is not None:
        try:
            run = load_run_config(options.run_config)
        except NodeError:
            return run, options.model_dir
    return run, options.model_dir or (run.model_dir if options.run_config is not None else None)


def run_doctor(options: DoctorOptions) -> Report:
    """Every check; NodeError only for a malformed ``--gpu`` (a usage error, not a finding)."""
    started = time.monotonic()
    selection = parse_gpu_selection(options.gpus)
    profile = probe(selection, options.data_dir)
    software = gather_software(profile.gpu_count)
    model, model_check = _model(options)
    network = trio.run(
        functools.partial(
            gather_network, list(options.bootstrap), options.listen, options.timeout, options.probe_bytes
        )
    )
    checks = (
        check_python(software),
        check_torch(software),
        check_gpu(profile, model),
        check_ram(profile),
        model_check,
        check_disk(profile, model, str(options.data_dir)),
        check_role(profile, model, options.role),
        check_device(profile, selection, *_run_and_model_dir(options)),
        check_bootstrap(network),
        check_reachability(network),
        check_clock(network),
        check_bandwidth(network, model),
    )
    return Report(checks, time.monotonic() - started)


__all__ = ["FAIL", "PASS", "DoctorOptions", "run_doctor"]
