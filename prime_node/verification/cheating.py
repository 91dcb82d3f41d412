"""Cheating inferers: the adversaries the validator is built to catch, for the demo's ``--adversary``,
``join --adversary``, the verification benchmark and the tests.

``CheatingProducer`` is the inferer's rollout producer for one attack (prime_node/roles/inferer_model.py
``RolloutProducer``): instead of the honest batch it publishes what a cheater of that kind would, and
validators must reject every one. It lives here, with the checks it attacks, rather than in the test kit
or the demo package: the node CLI and the role runner pick it, and neither may depend on either.

A ``Scenario`` is one run seen by one worker: a policy (engine, tokenizer), the task, a run config and
a worker wallet. ``honest_frames`` returns the signed envelope frame an honest worker publishes;
``attack_frames(name)`` the frames a cheater of that kind publishes (the replay attack sends two).
``EXPECTED_REASONS[name]`` lists the reason codes that count as catching it.

Every cheat does real work with real models (no mocks): the other-model cheater generates with a
model of another seed, the perturbed one with the honest weights × (1 + 0.01·N(0, 1)); the reward
inflater writes the correct answers and recomputes matching TOPLOC proofs with a prefill, so only the
sampling replay can catch it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from crypto.keys import WalletKey
from crypto.toploc import TOPK
from crypto.toploc_field import FIELD_PRIME, MIN_MODULUS
from prime_node.errors import NodeError
from prime_node.ml.engine import SamplingParams, prefill_logprobs
from prime_node.ml.engines import setup_engine
from prime_node.ml.evaluation import encode_prompt
from prime_node.ml.model import create_tiny_model
from prime_node.verification.proofs import build_proofs
from prime_node.verification.proving import proven_batch, seal_batch
from prime_node.verification.reasons import Reason
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.rollouts import RolloutBatch, RolloutSample, pack_logprobs, pack_tokens

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.ml.engine import InferenceEngine
    from prime_node.tasks.base import TaskSource

ATTACKS = (
    "forged_proof",
    "other_model",
    "perturbed_weights",
    "tampered_token",
    "replayed_batch",
    "stale_policy",
    "off_schedule",
    "inflated_reward",
    "bad_signature",
)

_TOPLOC = frozenset(
    {Reason.TOPLOC_EXPONENT_MISMATCH, Reason.TOPLOC_MANTISSA_MEAN, Reason.TOPLOC_MANTISSA_MEDIAN}
)
_RECOMPUTATION = _TOPLOC | {Reason.SAMPLING_MISMATCH, Reason.LOGPROB_MISMATCH}
EXPECTED_REASONS: dict[str, frozenset[Reason]] = {
    "forged_proof": _TOPLOC,
    "other_model": _RECOMPUTATION,
    "perturbed_weights": _RECOMPUTATION,
    "tampered_token": frozenset({Reason.SAMPLING_MISMATCH}),
    "replayed_batch": frozenset({Reason.REPLAY}),
    "stale_policy": frozenset({Reason.STALE_POLICY}),
    "off_schedule": frozenset({Reason.OFF_SCHEDULE_TASK}),
    "inflated_reward": frozenset({Reason.SAMPLING_MISMATCH}),
    "bad_signature": frozenset({Reason.BAD_SIGNATURE, Reason.SIGNER_MISMATCH}),
}


def with_completions(
    engine: Any, samples: Sequence[RolloutSample], completions: list[list[int]], temperature: float
) -> list[RolloutSample]:
    """``samples`` with their completions replaced by ``completions`` (finished), and the log-probs and
    TOPLOC proofs recomputed on ``engine`` to match: a forgery every check but the replay and the reward
    accepts."""

    prompts = [list(sample.prompt_tokens()) for sample in samples]
    prefills = engine.prefill(prompts, completions)
    proofs = build_proofs([prefill.hidden for prefill in prefills])
    every = prefill_logprobs(prefills, completions, temperature).cpu().tolist()  # a chunk of logits at a time
    starts = np.cumsum([0, *(len(c) for c in completions)]).tolist()
    forged = []
    for index, (sample, tokens, proof) in enumerate(zip(samples, completions, proofs, strict=True)):
        logps = every[starts[index] : starts[index + 1]]
        forged.append(
            replace(
                sample,
                completion=pack_tokens(tokens),
                logprobs=pack_logprobs([min(v, 0.0) for v in logps]),
                finished=True,
                proof=proof,
            )
        )
    return forged


@dataclass
class Scenario:
    """One run seen by one worker and one validator, at trainer step ``current_step``."""

    config: Any
    task: Any
    tokenizer: Any
    engine: Any
    key: WalletKey = field(default_factory=WalletKey.generate)
    current_step: int = 5
    now_ms: int = 1_700_000_000_000
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    _cheat_engines: dict[str, Any] = field(default_factory=dict)

    def engines(self, step: int) -> Any:
        """What the validator holds: the policy for every step within the async bound."""
        low = self.current_step - self.config.async_level
        return self.engine if low <= step <= self.current_step else None

    def batch(self, counter: int, *, engine: Any = None, policy_step: int | None = None) -> RolloutBatch:

        return proven_batch(
            engine or self.engine,
            self.task,
            self.tokenizer,
            self.config,
            worker=self.key.address,
            policy_step=self.current_step if policy_step is None else policy_step,
            batch_counter=counter,
        )

    def seal(self, batch: RolloutBatch) -> bytes:

        return encode(seal_batch(self.key, batch, now_ms=self.now_ms))

    def honest_frames(self, counter: int) -> list[bytes]:
        return [self.seal(self.batch(counter))]

    def attack_frames(self, attack: str, counter: int) -> list[bytes]:
        build: Callable[[int], list[bytes]] = getattr(self, f"_{attack}")
        return build(counter)

    # -- the cheats ---------------------------------------------------------------------------------

    def _forged_proof(self, counter: int) -> list[bytes]:
        """Honest tokens, but proofs of made-up values (skipping the hidden-state work entirely)."""
        batch = self.batch(counter)
        samples = []
        for sample in batch.samples:
            chunks = len(sample.proof) // (2 + 2 * TOPK)
            words = np.column_stack(
                [
                    self.rng.integers(MIN_MODULUS, FIELD_PRIME + 1, size=(chunks, 1)),
                    self.rng.integers(0, FIELD_PRIME, size=(chunks, TOPK)),
                ]
            )
            samples.append(replace(sample, proof=words.astype(">u2").tobytes()))
        return [self.seal(replace(batch, samples=tuple(samples)))]

    def _other_model(self, counter: int) -> list[bytes]:
        return [self.seal(self.batch(counter, engine=self._cheat_engine("other_model")))]

    def _perturbed_weights(self, counter: int) -> list[bytes]:
        return [self.seal(self.batch(counter, engine=self._cheat_engine("perturbed_weights")))]

    def _tampered_token(self, counter: int) -> list[bytes]:
        """One token of one honest completion replaced after generation (proof and log-probs kept)."""
        batch = self.batch(counter)
        eos = self.tokenizer.eos_token_id
        editable = [len(s.completion_tokens()) - int(s.finished) for s in batch.samples]
        victims = [i for i, n in enumerate(editable) if n > 0]
        victim = int(self.rng.choice(victims))
        sample = batch.samples[victim]
        tokens = list(sample.completion_tokens())
        position = int(self.rng.integers(0, editable[victim]))
        choices = [t for t in range(len(self.tokenizer)) if t not in (eos, tokens[position])]
        tokens[position] = int(self.rng.choice(choices))
        changed = replace(sample, completion=pack_tokens(tokens))
        samples = list(batch.samples)
        samples[victim] = changed
        return [self.seal(replace(batch, samples=tuple(samples)))]

    def _replayed_batch(self, counter: int) -> list[bytes]:
        frame = self.seal(self.batch(counter))
        return [frame, frame]

    def _stale_policy(self, counter: int) -> list[bytes]:
        old = self.current_step - self.config.async_level - 1
        return [self.seal(self.batch(counter, policy_step=old))]

    def _off_schedule(self, counter: int) -> list[bytes]:
        """A batch of hand-picked tasks (the easiest first ids of the pool) instead of the drawn ones."""

        batch = self.batch(counter)
        pool = self.task.train_ids()
        config = self.config
        picked = [pool[g] for g in range(batch.groups) for _ in range(batch.group_size)]
        prompts = [encode_prompt(self.tokenizer, self.task.prompt(t)) for t in picked]
        seeds = [s.seed for s in batch.samples]
        params = SamplingParams(config.max_new_tokens, config.temperature, return_hidden=True)
        completions = self.engine.generate(prompts, seeds, params)
        proofs = build_proofs([c.hidden for c in completions])
        samples = tuple(
            RolloutSample(
                task_id=picked[i],
                seed=seeds[i],
                prompt=pack_tokens(prompts[i]),
                completion=pack_tokens(c.tokens),
                logprobs=pack_logprobs([min(v, 0.0) for v in c.logprobs]),
                finished=c.finished,
                proof=proofs[i],
            )
            for i, c in enumerate(completions)
        )
        if [s.task_id for s in samples] == [s.task_id for s in batch.samples]:
            raise RuntimeError("the hand-picked tasks happen to be the drawn ones; pick another counter")
        return [self.seal(replace(batch, samples=samples))]

    def _inflated_reward(self, counter: int) -> list[bytes]:
        """Correct answers written in, with log-probs and TOPLOC proofs recomputed to match them."""

        batch = self.batch(counter)
        eos = self.tokenizer.eos_token_id
        limit = self.config.max_new_tokens
        answers = [
            [*encode_prompt(self.tokenizer, self.task.answer(sample.task_id))[: limit - 1], eos]
            for sample in batch.samples
        ]
        samples = with_completions(self.engine, batch.samples, answers, batch.temperature)
        return [self.seal(replace(batch, samples=tuple(samples)))]

    def _bad_signature(self, counter: int) -> list[bytes]:

        envelope = decode(self.seal(self.batch(counter)), Envelope)
        signature = bytearray(envelope.signature)
        signature[5] ^= 0x01
        return [encode(replace(envelope, signature=bytes(signature)))]

    def _cheat_engine(self, kind: str) -> Any:
        if kind not in self._cheat_engines:
            import torch

            if kind == "other_model":
                model, _ = create_tiny_model(seed=1)
            else:
                model = copy.deepcopy(self.engine.model)
                generator = torch.Generator().manual_seed(7)
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.mul_(1 + 0.01 * torch.randn(parameter.shape, generator=generator))
            self._cheat_engines[kind] = setup_engine(model, self.tokenizer, engine=self.config.engine)
        return self._cheat_engines[kind]


class CheatingProducer:
    """The rollout producer of an inferer that cheats with ``attack`` (one of ``ATTACKS``)."""

    def __init__(self, attack: str, *, key: WalletKey, run_config: RunConfig) -> None:
        if attack not in ATTACKS:
            raise NodeError(f"unknown adversary {attack!r}: one of {', '.join(ATTACKS)}", reason="bad_config")
        self.adversary: str = attack
        self.key = key
        self.config = run_config

    def frames(
        self,
        *,
        engine: InferenceEngine,
        tokenizer: Any,
        task: TaskSource,
        policy_step: int,
        counter: int,
        now_ms: int,
    ) -> list[bytes]:
        """The attack's frames for ``counter``, made with the policy in hand (a fresh scenario each time,
        so every batch is cheated the same way)."""
        if self.adversary == "stale_policy" and policy_step - self.config.async_level - 1 < 0:
            raise ValueError("no policy old enough to be stale yet")
        scenario = Scenario(
            config=self.config,
            task=task,
            tokenizer=tokenizer,
            engine=engine,
            key=self.key,
            current_step=policy_step,
            now_ms=now_ms,
        )
        return scenario.attack_frames(self.adversary, counter)
