"""Gather the facts and run every check, in the order a person reads them: software, machine, the run
(with ``--run RUN@0xTRAINER,...``: its signed config and newest checkpoint, learnt as ``join`` learns
them), role and its device (with the VRAM plan), then the network (which needs ``--bootstrap``)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from crypto.keys import Address
from prime_node.config.run import RunConfig, load_run_config
from prime_node.doctor.device import check_device
from prime_node.doctor.machine import check_disk, check_gpu, check_ram
from prime_node.doctor.model_size import ModelEstimate, default_estimate, estimate, from_run
from prime_node.doctor.network import (
    check_bandwidth,
    check_bootstrap,
    check_clock,
    check_reachability,
    gather_network,
)
from prime_node.doctor.report import FAIL, PASS, WARN, Check, Report
from prime_node.doctor.role import check_role, join_profile
from prime_node.doctor.run_model import RunModel, json_facts, learn_run
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
    run_id: str | None = None
    trainer: Address | None = None
    """``--run RUN@0xTRAINER``: learn that run's config and model from ``bootstrap`` as ``join`` does."""
    threads: int = 0
    """``--threads``, as for ``join``: the cores the node offers its role (0: every core)."""


RUN_FIX = (
    "check the run address (RUN@0xTRAINER,BOOTSTRAP from the run's operator) and that its bootstrap node "
    "is running; the role below is sized from an estimate"
)


def _learnt(options: DoctorOptions) -> RunModel | None:
    if options.run_id is None or options.trainer is None:
        return None
    return trio.run(
        functools.partial(
            learn_run,
            list(options.bootstrap),
            options.run_id,
            options.trainer,
            options.data_dir,
            options.listen,
            options.timeout,
        )
    )


def _run_check(learnt: RunModel) -> Check:
    facts = json_facts(learnt)
    if learnt.config is None:
        return Check("run", FAIL, f"run {learnt.run_id}@{learnt.trainer}: {learnt.error}", RUN_FIX, facts)
    head = f"run {learnt.run_id}: config signed by trainer {learnt.trainer}"
    if learnt.join_error is not None:
        fix = "put the run's task file where the line says (join stops on it too)"
        return Check("run", FAIL, f"{head}; join would stop: {learnt.join_error}", fix, facts)
    if learnt.error is not None:
        fix = "wait for the trainer's first checkpoint, or use a bootstrap node that holds one"
        return Check("run", WARN, f"{head}; {learnt.error}", fix, facts)
    return Check("run", PASS, f"{head}, newest checkpoint step {learnt.step}", None, facts)


def _model(options: DoctorOptions, learnt: RunModel | None) -> tuple[ModelEstimate, Check]:
    try:
        model = from_run(learnt) if learnt is not None else estimate(options.model_dir, options.run_config)
    except NodeError as exc:
        model = default_estimate()
        fix = (
            "pass --model a Hugging Face model directory (config.json, *.safetensors) or a valid --run-config"
        )
        return model, Check("model", FAIL, f"{exc}; using the {model.source}", fix)
    details = {"checkpoint_bytes": model.checkpoint_bytes, "keep": model.keep, "source": model.source}
    return model, Check("model", PASS, model.source, None, details)


def _run_and_model_dir(options: DoctorOptions, announced: RunConfig | None) -> tuple[RunConfig, Path | None]:
    """The run config (the announced one with --run; defaults without --run-config, or when it does not
    load: ``model`` reports that) and the model directory, for the device check's VRAM plan."""
    if announced is not None:
        return announced, options.model_dir
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
    learnt = _learnt(options)
    model, model_check = _model(options, learnt)
    config = learnt.config if learnt is not None else None
    role_profile = join_profile(profile, config, options.role, options.threads)
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
        *((_run_check(learnt),) if learnt is not None else ()),
        model_check,
        check_disk(profile, model, str(options.data_dir)),
        check_role(role_profile, model, options.role),
        check_device(profile, selection, *_run_and_model_dir(options, config)),
        check_bootstrap(network),
        check_reachability(network),
        check_clock(network),
        check_bandwidth(network, model),
    )
    return Report(checks, time.monotonic() - started)


__all__ = ["FAIL", "PASS", "DoctorOptions", "run_doctor"]
