"""The role policy: capability rules, pins and the trainer key, and no flapping under any demand."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from protocol.errors import InvariantError, LocalProtocolError
from protocol.resources import GpuInfo, HardwareProfile, RunRequirements
from protocol.roles import (
    INFERER,
    ROLES,
    SEEDER,
    TRAINER,
    VALIDATOR,
    RoleDecision,
    RolePolicyConfig,
    RoleState,
    SwarmDemand,
    choose_role,
    inference_fit,
    validation_fit,
)

POLICY = RolePolicyConfig()
RTX_4090 = HardwareProfile((GpuInfo(0, "RTX 4090", 24564, (8, 9)),), 16, 64 << 10, 500 << 10, "nvml")
LAPTOP = HardwareProfile((), 2, 8 << 10, 50 << 10)
TINY_DEMO = RunRequirements(
    param_count=120_000, dtype_bytes=4, context_tokens=32, cpu_ok=True, min_tokens_per_s=50
)
QWEN_1B = RunRequirements.for_model(
    param_count=1_000_000_000,
    dtype_bytes=2,
    num_layers=28,
    kv_width=256,
    context_tokens=4096,
    needs_bf16=True,
)
QWQ_32B = RunRequirements(param_count=32_000_000_000, dtype_bytes=2, context_tokens=8192)

gpus = st.lists(
    st.builds(
        GpuInfo,
        index=st.integers(0, 7),
        name=st.just("GPU"),
        vram_mib=st.integers(0, 200_000),
        compute_capability=st.one_of(st.none(), st.tuples(st.integers(5, 10), st.integers(0, 9))),
    ),
    max_size=4,
).map(tuple)
profiles = st.builds(
    HardwareProfile,
    gpus=gpus,
    cpu_cores=st.integers(1, 256),
    ram_mib=st.integers(0, 2_000_000),
    disk_free_mib=st.integers(0, 10_000_000),
)
requirements = st.builds(
    RunRequirements,
    param_count=st.integers(1, 100_000_000_000),
    dtype_bytes=st.sampled_from([1, 2, 4]),
    context_tokens=st.integers(1, 131_072),
    kv_bytes_per_token=st.integers(0, 1 << 20),
    concurrent_sequences=st.integers(1, 64),
    cpu_ok=st.booleans(),
    min_tokens_per_s=st.floats(0, 10_000),
    multi_gpu=st.booleans(),
    needs_bf16=st.booleans(),
)
demands = st.builds(
    SwarmDemand,
    backlog=st.integers(0, 40),
    inferers=st.integers(0, 5),
    validators=st.integers(0, 5),
    validator_batches_per_s=st.floats(0, 10),
)
policies = st.builds(
    lambda high, gap, validators, dwell: RolePolicyConfig(
        backlog_high=high, backlog_low=max(0, high - gap), min_validators=validators, min_dwell_s=dwell
    ),
    st.integers(1, 20),
    st.integers(1, 20),
    st.integers(1, 3),
    st.floats(0, 300),
)


# Sequences of switches need nodes that can do both jobs: mix known capable pairs into the random ones.
capable_profiles = st.one_of(st.just(RTX_4090), st.just(LAPTOP), profiles)
capable_requirements = st.one_of(st.just(QWEN_1B), st.just(TINY_DEMO), requirements)


def _decide(
    profile: HardwareProfile, req: RunRequirements, demand: SwarmDemand, **policy: object
) -> RoleDecision:
    return choose_role(profile, req, demand, None, 0.0, RolePolicyConfig(**policy))  # type: ignore[arg-type]


def test_examples_read_like_sentences() -> None:
    decision = _decide(RTX_4090, QWEN_1B, SwarmDemand(backlog=3, validators=1, inferers=2))
    assert decision.role == INFERER and decision.changed
    assert decision.reason.startswith("inferer: 24.0 GiB VRAM >= ") and "backlog 3 < 8" in decision.reason
    laptop = _decide(LAPTOP, QWQ_32B, SwarmDemand())
    assert laptop.role == SEEDER and "no GPU" in laptop.reason and "does not allow CPU" in laptop.reason
    demo = _decide(LAPTOP, TINY_DEMO, SwarmDemand())
    assert demo.role == INFERER and "CPU:" in demo.reason and "tokens/s" in demo.reason
    big_on_cpu = _decide(LAPTOP, QWEN_1B, SwarmDemand())
    assert big_on_cpu.role == VALIDATOR and "cannot infer" in big_on_cpu.reason
    one_4090 = _decide(RTX_4090, QWQ_32B, SwarmDemand())
    assert one_4090.role == SEEDER and "24.0 GiB VRAM < " in one_4090.reason
    h100s = HardwareProfile(tuple(GpuInfo(i, "H100", 81559, (9, 0)) for i in range(8)), 64, 1 << 20, 1 << 20)
    assert _decide(h100s, QWQ_32B, SwarmDemand()).role == INFERER
    assert _decide(RTX_4090, QWEN_1B, SwarmDemand(backlog=9)).reason.startswith("validator: backlog 9 >= 8")
    assert _decide(RTX_4090, QWEN_1B, SwarmDemand(inferers=3)).role == VALIDATOR


def test_old_gpus_without_bf16_do_not_serve_bf16_models() -> None:
    t4 = HardwareProfile((GpuInfo(0, "T4", 15360, (7, 5)),), 8, 32 << 10, 1 << 20)
    fit = inference_fit(t4, QWEN_1B, POLICY)
    assert not fit.ok and "bf16" in fit.why


def test_trainer_key_and_pins() -> None:
    assert _decide(LAPTOP, QWQ_32B, SwarmDemand(), holds_trainer_key=True).role == TRAINER
    with pytest.raises(LocalProtocolError, match="trainer key") as raised:
        _decide(RTX_4090, QWEN_1B, SwarmDemand(), pinned=TRAINER)
    assert raised.value.reason == "not_trainer_key"
    pinned = _decide(LAPTOP, QWQ_32B, SwarmDemand(), pinned=INFERER)
    assert pinned.role == INFERER and "pinned by --role" in pinned.reason and "warning" in pinned.reason
    assert _decide(RTX_4090, QWEN_1B, SwarmDemand(), pinned="auto").role == INFERER
    with pytest.raises(InvariantError, match="unknown role"):
        RolePolicyConfig(pinned="boss")
    with pytest.raises(InvariantError, match="backlog_low"):
        RolePolicyConfig(backlog_low=8, backlog_high=8)
    with pytest.raises(InvariantError, match="min_validators"):
        RolePolicyConfig(min_validators=0)


def test_a_switch_waits_for_the_dwell_time() -> None:
    policy = RolePolicyConfig(min_dwell_s=60)
    state = RoleState(INFERER, since=100.0)
    busy = SwarmDemand(backlog=20, validators=1, inferers=3)
    early = choose_role(RTX_4090, QWEN_1B, busy, state, 130.0, policy)
    assert early.role == INFERER and not early.changed and "would switch to validator" in early.reason
    late = choose_role(RTX_4090, QWEN_1B, busy, state, 160.0, policy)
    assert late.role == VALIDATOR and late.changed
    after = late.next_state(state, 160.0)
    assert after == RoleState(VALIDATOR, 160.0)
    # between the thresholds nothing moves, whatever the time
    middle = SwarmDemand(backlog=5, validators=2, inferers=3)
    assert choose_role(RTX_4090, QWEN_1B, middle, after, 1e6, policy).role == VALIDATOR
    assert choose_role(RTX_4090, QWEN_1B, middle, state, 1e6, policy).role == INFERER
    # the last validator stays even when the backlog is empty
    lonely = choose_role(RTX_4090, QWEN_1B, SwarmDemand(backlog=0, inferers=3), after, 1e6, policy)
    assert lonely.role == VALIDATOR and "only 0 other validator" in lonely.reason
    back = choose_role(RTX_4090, QWEN_1B, SwarmDemand(backlog=1, validators=1), after, 1e6, policy)
    assert back.role == INFERER and back.changed


@given(profiles, requirements, demands, policies, st.booleans(), st.sampled_from([None, *ROLES]))
def test_trainer_only_with_the_key_and_pins_always_win(
    profile: HardwareProfile,
    req: RunRequirements,
    demand: SwarmDemand,
    policy: RolePolicyConfig,
    key: bool,
    pin: str | None,
) -> None:
    policy = dataclasses.replace(policy, holds_trainer_key=key, pinned=pin)
    if pin == TRAINER and not key:
        with pytest.raises(LocalProtocolError):
            choose_role(profile, req, demand, None, 0.0, policy)
        return
    decision = choose_role(profile, req, demand, None, 0.0, policy)
    assert decision.role in ROLES and decision.reason.startswith(decision.role + ":")
    if pin is not None:
        assert decision.role == pin
    elif key:
        assert decision.role == TRAINER
    assert decision.role != TRAINER or key


@given(profiles, requirements, demands, policies)
def test_roles_follow_capability(
    profile: HardwareProfile, req: RunRequirements, demand: SwarmDemand, policy: RolePolicyConfig
) -> None:
    decision = choose_role(profile, req, demand, None, 0.0, policy)
    infer, validate = inference_fit(profile, req, policy), validation_fit(profile, req, policy)
    assert not infer.ok or validate.ok  # validating never takes more than inferring
    expected = {INFERER, VALIDATOR} if infer.ok else {VALIDATOR} if validate.ok else {SEEDER}
    assert decision.role in expected


@given(profiles, requirements, policies, st.integers(1, 100_000), st.integers(1, 64), st.integers(1, 1 << 20))
def test_more_hardware_never_loses_a_capability(
    profile: HardwareProfile, req: RunRequirements, policy: RolePolicyConfig, vram: int, cores: int, ram: int
) -> None:
    bigger = dataclasses.replace(
        profile,
        gpus=tuple(dataclasses.replace(gpu, vram_mib=gpu.vram_mib + vram) for gpu in profile.gpus),
        cpu_cores=profile.cpu_cores + cores,
        ram_mib=profile.ram_mib + ram,
    )
    for fit in (inference_fit, validation_fit):
        assert fit(bigger, req, policy).ok or not fit(profile, req, policy).ok


@given(profiles, requirements, policies, st.integers(1, 10_000_000_000))
def test_a_bigger_model_never_gains_a_capability(
    profile: HardwareProfile, req: RunRequirements, policy: RolePolicyConfig, extra: int
) -> None:
    bigger = dataclasses.replace(req, param_count=req.param_count + extra)
    for fit in (inference_fit, validation_fit):
        assert fit(profile, req, policy).ok or not fit(profile, bigger, policy).ok


def _simulate(
    profile: HardwareProfile,
    req: RunRequirements,
    policy: RolePolicyConfig,
    steps: list[tuple[float, SwarmDemand]],
) -> list[tuple[float, str]]:
    """Roles over time; returns (time, new role) for each switch after the first choice."""
    now = 0.0
    state: RoleState | None = None
    switches = []
    for gap, demand in steps:
        now += gap
        decision = choose_role(profile, req, demand, state, now, policy)
        if state is not None and decision.changed:
            switches.append((now, decision.role))
        assert decision.changed == (state is None or decision.role != state.role)
        state = decision.next_state(state, now)
    return switches


@given(
    capable_profiles,
    capable_requirements,
    policies,
    st.lists(st.tuples(st.floats(0, 120), demands), min_size=1, max_size=60),
)
def test_no_flapping_under_any_demand(
    profile: HardwareProfile,
    req: RunRequirements,
    policy: RolePolicyConfig,
    steps: list[tuple[float, SwarmDemand]],
) -> None:
    switches = _simulate(profile, req, policy, steps)
    times = [at for at, _ in switches]
    assert all(later - earlier >= policy.min_dwell_s for earlier, later in itertools.pairwise(times))
    assert all(role in (INFERER, VALIDATOR) for _, role in switches)


@given(
    capable_profiles,
    capable_requirements,
    policies,
    demands,
    st.lists(st.floats(0, 1000), min_size=1, max_size=40),
)
def test_steady_demand_switches_at_most_once(
    profile: HardwareProfile,
    req: RunRequirements,
    policy: RolePolicyConfig,
    demand: SwarmDemand,
    gaps: list[float],
) -> None:
    assume(len(gaps) > 1)
    assert len(_simulate(profile, req, policy, [(gap, demand) for gap in gaps])) <= 1


@given(
    st.sampled_from([(RTX_4090, QWEN_1B), (LAPTOP, TINY_DEMO)]),
    policies,
    st.lists(st.tuples(st.floats(0, 120), demands), min_size=10, max_size=200),
)
def test_no_flapping_for_a_node_that_can_do_both(
    node: tuple[HardwareProfile, RunRequirements],
    policy: RolePolicyConfig,
    steps: list[tuple[float, SwarmDemand]],
) -> None:
    switches = _simulate(*node, policy, steps)
    times = [at for at, _ in switches]
    assert all(later - earlier >= policy.min_dwell_s for earlier, later in itertools.pairwise(times))
    assert all(role != previous for (_, role), (_, previous) in zip(switches[1:], switches, strict=False))
