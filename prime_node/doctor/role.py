"""The role this machine would take in the run and why: ``prime_node.roles.choice.decide_role``, the same
function ``join``'s runner calls, on the profile ``join`` would offer (its cores capped by ``--threads``,
the CPU decode rate measured where the run lets the CPU infer), the run's requirements and an empty
swarm (demand is only known to a running node)."""

from __future__ import annotations

import dataclasses

from prime_node.config import RunConfig
from prime_node.cpu_compute import role_threads
from prime_node.doctor.model_size import ModelEstimate
from prime_node.doctor.report import FAIL, PASS, WARN, Check
from prime_node.errors import NodeError
from prime_node.roles.choice import decide_role
from prime_node.roles.role_runner import RoleSettings, measured_profile
from protocol.resources import HardwareProfile
from protocol.roles import SEEDER, RoleDecision, SwarmDemand


def join_profile(
    probed: HardwareProfile, config: RunConfig | None, pinned: str | None, threads: int
) -> HardwareProfile:
    """The profile ``join --threads THREADS`` offers the policy (``RoleRunner.run``): cores capped by the
    role's threads and, with the run known and no role pinned, the CPU decode rate measured."""

    threads = role_threads(threads)
    profile = dataclasses.replace(probed, cpu_cores=min(probed.cpu_cores, threads))
    if config is not None and pinned is None:
        profile = measured_profile(profile, config, threads)
    return profile


def join_decision(profile: HardwareProfile, model: ModelEstimate, pinned: str | None) -> RoleDecision:
    """What ``join`` decides first on this machine (no trainer key: the doctor unlocks no wallet)."""
    return decide_role(
        profile,
        model.requirements,
        SwarmDemand(),
        None,
        0.0,
        pinned=pinned,
        holds_trainer_key=False,
        min_dwell_s=RoleSettings().min_dwell_s,
    )


def check_role(profile: HardwareProfile, model: ModelEstimate, pinned: str | None = None) -> Check:
    try:
        decision = join_decision(profile, model, pinned)
    except NodeError as exc:
        return Check("role", FAIL, str(exc), "drop --role, or use the run's trainer wallet", {"role": None})
    details = {"role": decision.role, "reason": decision.reason, "model": model.source}
    value = decision.reason
    if decision.role == SEEDER:
        return Check(
            "role",
            WARN,
            value,
            "this machine can only re-serve checkpoint pieces for this model; a GPU (or more RAM) lets it "
            "infer or validate",
            details,
        )
    return Check("role", PASS, value, None, details)
