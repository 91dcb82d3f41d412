"""The validator's pipeline on real signed batches from real tiny models, honest and cheating."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from crypto.keys import WalletKey
from prime_node.testing.adversary import build_scenario, validator_for
from prime_node.verification.cheating import ATTACKS, EXPECTED_REASONS, Scenario
from prime_node.verification.proving import seal_batch
from prime_node.verification.reasons import Reason
from protocol.codec import decode, encode
from protocol.envelope import EnvelopeVerifier, seal
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.rollouts import pack_tokens
from protocol.verdict import Verdict, open_verdict, seal_verdict, verdict_domain


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return build_scenario()


def check(scenario: Scenario, frames: list[bytes], **kwargs: Any) -> Any:
    validator = validator_for(scenario)
    results = [
        validator.validate_frame(
            frame, now_ms=scenario.now_ms, current_step=kwargs.get("current_step", scenario.current_step)
        )
        for frame in frames
    ]
    return results[-1]


def test_honest_batches_are_accepted_with_recomputed_rewards(scenario: Scenario) -> None:
    validator = validator_for(scenario)
    for counter in range(3):
        [frame] = scenario.honest_frames(counter)
        result = validator.validate_frame(frame, now_ms=scenario.now_ms, current_step=scenario.current_step)
        assert result.accepted, result.detail
        assert len(result.rewards) == scenario.config.samples_per_step
        verdict = result.verdict()
        assert verdict is not None and verdict.accepted and verdict.reasons == ()
        assert decode(encode(verdict), Verdict) == verdict


@pytest.mark.parametrize("attack", ATTACKS)
def test_every_attack_is_rejected_with_its_reason(scenario: Scenario, attack: str) -> None:
    result = check(scenario, scenario.attack_frames(attack, counter=100 + ATTACKS.index(attack)))
    assert not result.accepted
    assert set(result.reasons) & EXPECTED_REASONS[attack], (attack, result.reasons, result.detail)


def test_the_right_reason_for_each_header_problem(scenario: Scenario) -> None:
    batch = scenario.batch(counter=7)
    cases = {
        Reason.WRONG_RUN: replace(batch, run_id="another-run"),
        Reason.FUTURE_POLICY: replace(batch, policy_step=scenario.current_step + 1),
        Reason.WRONG_TEMPERATURE: replace(batch, temperature=0.5),
        Reason.WRONG_SHAPE: replace(batch, samples=batch.samples[: batch.group_size]),
    }
    for reason, changed in cases.items():
        # Sealed for this run's rollout domain whatever the payload says (else: wrong_domain first).
        frame = encode(seal(scenario.key, run_domain(scenario), encode(changed), now_ms=scenario.now_ms))
        result = check(scenario, [frame])
        assert result.reasons == [reason]
    # A validator that lost the policy cannot judge the batch.
    scenario_without = replace(scenario)
    scenario_without.engines = lambda step: None  # type: ignore[method-assign]
    result = check(scenario_without, [scenario.seal(batch)])
    assert result.reasons == [Reason.UNKNOWN_POLICY]


def test_the_right_reason_for_each_sample_problem(scenario: Scenario) -> None:
    batch, index = batch_with_a_spoken_sample(scenario)
    first = batch.samples[index]
    tokens = list(first.completion_tokens())
    eos = scenario.tokenizer.eos_token_id
    cut = [t for t in tokens if t != eos][:3]
    outside = len(scenario.tokenizer) + 5
    cases = {
        Reason.WRONG_SEED: replace(first, seed=first.seed ^ 1),
        Reason.WRONG_PROMPT: replace(first, prompt=pack_tokens([*first.prompt_tokens(), 10])),
        Reason.BAD_COMPLETION: replace(first, completion=pack_tokens([outside] * len(tokens))),
        Reason.ILLEGITIMATE_TERMINATION: replace(
            first, completion=pack_tokens(cut), logprobs=first.logprobs[: 4 * len(cut)], finished=False
        ),
        Reason.MISSING_PROOF: replace(first, proof=b""),
        Reason.MALFORMED_PROOF: replace(first, proof=b"\x00\x00" + first.proof[2:]),
        Reason.LOGPROB_MISMATCH: replace(first, logprobs=pack_logprobs_shifted(first.completion_logprobs())),
    }
    for reason, sample in cases.items():
        samples = list(batch.samples)
        samples[index] = sample
        changed = replace(batch, samples=tuple(samples))
        result = check(scenario, [scenario.seal(changed)])
        assert result.reasons == [reason], (reason, result.reasons, result.detail)
        assert result.rejected_samples == [index]
        verdict = result.verdict()
        assert verdict is not None and not verdict.accepted and verdict.reasons == (reason,)


def batch_with_a_spoken_sample(scenario: Scenario) -> tuple[Any, int]:
    """A batch and the index of a sample that says something before EOS.

    Which samples end at once depends on the sampled tokens, so on the machine's float kernels: a
    tiny model answered EOS first on one CPU. An illegitimate termination needs a token to cut at.
    """
    eos = scenario.tokenizer.eos_token_id
    for counter in range(8, 40):
        batch = scenario.batch(counter=counter)
        for index, sample in enumerate(batch.samples):
            if any(token != eos for token in sample.completion_tokens()):
                return batch, index
    raise AssertionError("32 batches of only empty answers: the scenario's model cannot speak")


def pack_logprobs_shifted(values: tuple[float, ...]) -> bytes:
    """Every claimed log-prob 0.01 lower: plausible numbers, but not the policy's."""
    from protocol.rollouts import pack_logprobs

    return pack_logprobs([v - 0.01 for v in values])


def test_a_batch_signed_by_someone_else_than_its_worker(scenario: Scenario) -> None:
    batch = scenario.batch(counter=9)
    frame = encode(seal_batch(WalletKey.generate(), batch, now_ms=scenario.now_ms))
    assert check(scenario, [frame]).reasons == [Reason.SIGNER_NOT_WORKER]


def run_domain(scenario: Scenario) -> Any:
    from prime_node.verification.proving import rollout_domain

    return rollout_domain(scenario.config.run_id)


def test_a_signed_payload_that_is_not_a_batch(scenario: Scenario) -> None:
    frame = encode(seal(scenario.key, run_domain(scenario), b"\x93\x01", now_ms=scenario.now_ms))
    result = check(scenario, [frame])
    assert result.reasons == [Reason.MALFORMED_BATCH] and result.verdict() is None


def test_an_expired_batch(scenario: Scenario) -> None:
    [frame] = scenario.honest_frames(10)
    validator = validator_for(scenario)
    later = scenario.now_ms + 3_600_000
    result = validator.validate_frame(frame, now_ms=later, current_step=scenario.current_step)
    assert result.reasons == [Reason.EXPIRED] and result.verdict() is None


@pytest.fixture(scope="module")
def honest_frame(scenario: Scenario) -> bytes:
    return scenario.honest_frames(11)[0]


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), flip=st.integers(0, 10_000))
def test_truncated_or_corrupted_frames_are_rejected_not_crashed(
    scenario: Scenario, honest_frame: bytes, cut: int, flip: int
) -> None:
    truncated = honest_frame[: cut % len(honest_frame)]
    assert check(scenario, [truncated]).reasons == [Reason.MALFORMED_ENVELOPE]
    corrupted = bytearray(honest_frame)
    corrupted[flip % len(corrupted)] ^= 0x40
    result = check(scenario, [bytes(corrupted)])
    assert not result.accepted  # whatever byte changed, the signature or the frame gives it away


def test_verdicts_are_signed_and_only_trusted_validators_count(scenario: Scenario) -> None:
    [frame] = scenario.honest_frames(12)
    verdict = check(scenario, [frame]).verdict()
    assert verdict is not None
    validator_key, stranger = WalletKey.generate(), WalletKey.generate()
    domain = verdict_domain(scenario.config.run_id)
    envelope = seal_verdict(validator_key, verdict, now_ms=scenario.now_ms)
    trusted = frozenset({validator_key.address})
    opened = open_verdict(envelope, EnvelopeVerifier(domain), trusted=trusted, now_ms=scenario.now_ms)
    assert opened == verdict
    forged = seal_verdict(stranger, verdict, now_ms=scenario.now_ms)
    with pytest.raises(RemoteProtocolError) as caught:
        open_verdict(forged, EnvelopeVerifier(domain), trusted=trusted, now_ms=scenario.now_ms)
    assert caught.value.reason == "untrusted_validator"


def test_a_verdict_is_accepted_exactly_when_it_has_no_reasons(scenario: Scenario) -> None:
    [frame] = scenario.honest_frames(13)
    verdict = check(scenario, [frame]).verdict()
    assert verdict is not None
    with pytest.raises(InvariantError):
        replace(verdict, reasons=("replay",))


@pytest.fixture(scope="module")
def mutable_batch(scenario: Scenario) -> Any:
    return scenario.batch(counter=20)


@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_signed_mutation_of_a_batch_gets_a_verdict_never_an_exception(
    scenario: Scenario, mutable_batch: Any, data: st.DataObject
) -> None:
    from protocol.rollouts import pack_logprobs

    batch = mutable_batch
    number = data.draw(st.integers(0, len(batch.samples) - 1))
    sample = batch.samples[number]
    n = len(sample.completion_tokens())
    kind = data.draw(st.sampled_from(["task", "seed", "completion", "finished", "proof", "logprobs"]))
    samples = list(batch.samples)
    if kind == "task":  # a whole group moved to another task (one sample alone would not even decode)
        group = number // batch.group_size
        task_id = data.draw(st.integers(0, (1 << 63) - 1))
        for i in range(group * batch.group_size, (group + 1) * batch.group_size):
            samples[i] = replace(samples[i], task_id=task_id)
    elif kind == "seed":
        samples[number] = replace(sample, seed=data.draw(st.integers(0, (1 << 63) - 1)))
    elif kind == "completion":
        tokens = data.draw(st.lists(st.integers(0, (1 << 31) - 1), min_size=n, max_size=n))
        samples[number] = replace(sample, completion=pack_tokens(tokens))
    elif kind == "finished":
        samples[number] = replace(sample, finished=not sample.finished)
    elif kind == "proof":
        size = len(sample.proof)
        samples[number] = replace(sample, proof=data.draw(st.binary(min_size=size, max_size=size)))
    else:
        values = data.draw(st.lists(st.floats(-1e6, 0.0, width=32), min_size=n, max_size=n))
        samples[number] = replace(sample, logprobs=pack_logprobs(values))
    result = check(scenario, [scenario.seal(replace(batch, samples=tuple(samples)))])
    if tuple(samples) == batch.samples:
        assert result.accepted
    else:
        assert not result.accepted or kind == "logprobs", (result.reasons, result.detail)
        assert result.accepted or set(result.rejected_samples) <= set(range(len(samples)))


def test_policies_load_by_step_from_disk_and_a_judge_signs_verdicts(
    scenario: Scenario, tmp_path: Path
) -> None:
    import torch

    from prime_node.ml.model import create_tiny_model, save_model_dir
    from prime_node.verification.judge import Judge, PolicyEngines
    from prime_node.verification.proving import rollout_domain
    from prime_node.verification.validator import BatchValidator

    save_model_dir(scenario.engine.model, scenario.tokenizer, tmp_path / "step_5")
    other, _ = create_tiny_model(1)
    save_model_dir(other, scenario.tokenizer, tmp_path / "step_4")
    engines = PolicyEngines(lambda step: tmp_path / f"step_{step}", scenario.tokenizer, keep=1)
    assert engines(3) is None
    loaded = engines(5)
    assert loaded is not None and loaded.policy_step == 5
    for name, tensor in scenario.engine.model.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name])
    validator = BatchValidator(
        scenario.config,
        scenario.task,
        scenario.tokenizer,
        engines,
        rollout_verifier=EnvelopeVerifier(rollout_domain(scenario.config.run_id)),
    )
    judge = Judge(validator, WalletKey.generate())
    [honest] = scenario.honest_frames(30)
    result, envelope = judge.judge(honest, now_ms=scenario.now_ms, current_step=5)
    assert result.accepted and envelope is not None and envelope.signer == judge.key.address
    # The same work claimed for step 4, whose checkpoint is another model: caught by recomputation.
    stale_claim = scenario.seal(scenario.batch(counter=31, policy_step=4))
    result, envelope = judge.judge(stale_claim, now_ms=scenario.now_ms, current_step=5)
    assert not result.accepted and Reason.TOPLOC_EXPONENT_MISMATCH in result.reasons
    assert envelope is not None and decode(envelope.payload, Verdict).accepted is False
    result, envelope = judge.judge(b"garbage", now_ms=scenario.now_ms, current_step=5)
    assert result.reasons == [Reason.MALFORMED_ENVELOPE] and envelope is None


def test_policy_engines_reuse_models_and_match_fresh_loads(scenario: Scenario, tmp_path: Path) -> None:
    import shutil

    import torch

    from prime_node.errors import NodeError
    from prime_node.ml.model import create_tiny_model, load_model, save_model_dir
    from prime_node.verification.judge import PolicyEngines

    for step in range(4):
        model, _ = create_tiny_model(10 + step)
        save_model_dir(model, scenario.tokenizer, tmp_path / f"step_{step}")
    engines = PolicyEngines(lambda step: tmp_path / f"step_{step}", scenario.tokenizer, keep=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for step in [0, 1, 2, 3, 0, 2, 2, 1, 3]:
        engine = engines(step)
        assert engine is not None and engine.policy_step == step
        with torch.no_grad():
            got = engine.model(ids).logits
            want = load_model(tmp_path / f"step_{step}")(ids).logits
        assert torch.allclose(got, want, rtol=0, atol=0)
    assert engines.builds == 2  # the pool size: every later policy was loaded into an existing model
    # A checkpoint that does not load is still a NodeError, and the engine it was meant for is dropped.
    broken = tmp_path / "step_9"
    shutil.copytree(tmp_path / "step_0", broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(NodeError) as caught:
        engines(9)
    assert caught.value.reason == "bad_model_dir"
    wrong = tmp_path / "step_8"
    shutil.copytree(tmp_path / "step_0", wrong)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(wrong / "model.safetensors"))
    weights.pop(next(iter(weights)))
    save_file(weights, str(wrong / "model.safetensors"))
    assert engines(2) is not None  # refills the pool, so step 8 is loaded into an existing model
    with pytest.raises(NodeError) as caught:
        engines(8)
    assert caught.value.reason == "bad_model_dir"
    engine = engines(1)
    assert engine is not None and engine.policy_step == 1
