"""Tiny scenarios to test the validator against the cheats of prime_node/verification/cheating.py.

``build_scenario`` makes a ``Scenario`` on a fresh tiny model and 2-digit addition; ``validator_for``
a validator holding that scenario's policies. The cheats themselves (``Scenario``, ``ATTACKS``,
``EXPECTED_REASONS``) live in ``prime_node.verification.cheating``, where the node picks them.
"""

from __future__ import annotations

from typing import Any

from prime_node.ml.engines import setup_engine
from prime_node.ml.model import create_tiny_model
from prime_node.tasks.arithmetic import ArithmeticTask
from prime_node.verification.cheating import Scenario
from prime_node.verification.proving import rollout_domain
from prime_node.verification.validator import BatchValidator
from protocol.envelope import EnvelopeVerifier


def build_scenario(
    *, model_seed: int = 0, group_size: int = 4, groups: int = 2, max_new_tokens: int = 12, **run: Any
) -> Scenario:
    """A scenario on a fresh tiny model (0.12M parameters) and 2-digit addition."""
    from prime_node.config import RunConfig

    model, tokenizer = create_tiny_model(model_seed)
    config = RunConfig(
        run_id=run.pop("run_id", "adversary"),
        group_size=group_size,
        prompts_per_step=groups,
        max_new_tokens=max_new_tokens,
        temperature=run.pop("temperature", 1.0),
        async_level=run.pop("async_level", 2),
        seed=run.pop("seed", 7),
        **run,
    )
    engine = setup_engine(model, tokenizer, engine=config.engine)
    return Scenario(config=config, task=ArithmeticTask(2), tokenizer=tokenizer, engine=engine)


def validator_for(scenario: Scenario) -> Any:
    """A BatchValidator holding the scenario's policies, with its own replay cache."""

    return BatchValidator(
        scenario.config,
        scenario.task,
        scenario.tokenizer,
        scenario.engines,
        rollout_verifier=EnvelopeVerifier(rollout_domain(scenario.config.run_id)),
    )
