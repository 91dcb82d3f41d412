"""The role this machine would take in the run and why: the pure policy (protocol/roles.py) on the probed
hardware, the run's requirements and an empty swarm (demand is only known to a running node)."""

from __future__ import annotations

from prime_node.doctor.model_size import ModelEstimate
from prime_node.doctor.report import FAIL, PASS, WARN, Check
from protocol.errors import ProtocolError
from protocol.roles import SEEDER, HardwareProfile, RolePolicyConfig, SwarmDemand, choose_role


def check_role(profile: HardwareProfile, model: ModelEstimate, pinned: str | None = None) -> Check:
    try:
        decision = choose_role(
            profile, model.requirements, SwarmDemand(), None, 0.0, RolePolicyConfig(pinned=pinned)
        )
    except ProtocolError as exc:
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
