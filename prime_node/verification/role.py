"""The validator role without the network: policies by step, and judging a frame into a signed verdict.

A node service (trio) wraps ``Judge``: it feeds it the rollout frames it fetches, runs ``judge`` in a
worker thread, and publishes the returned verdict envelope. ``PolicyEngines`` is the ``engines(step)``
a ``BatchValidator`` asks for: it loads each policy step from the checkpoint directory the node
already holds (Hugging Face layout, safetensors only) and keeps the most recent few in memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crypto.keys import WalletKey
from prime_node.verification.validator import BatchValidator, ValidationResult
from protocol.envelope import Envelope
from protocol.verdict import seal_verdict

if TYPE_CHECKING:
    from prime_node.ml.engine import TorchEngine


class PolicyEngines:
    """``engines(step)``: an engine holding policy ``step``, or None when no checkpoint for it exists.

    ``locate(step)`` names the step's model directory (or None); at most ``keep`` engines stay loaded,
    the least recently used is dropped first.
    """

    def __init__(self, locate: Callable[[int], Path | None], tokenizer: Any, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep at least one policy")
        self.locate = locate
        self.tokenizer = tokenizer
        self.keep = keep
        self._loaded: OrderedDict[int, TorchEngine] = OrderedDict()

    def __call__(self, step: int) -> TorchEngine | None:
        if step in self._loaded:
            self._loaded.move_to_end(step)
            return self._loaded[step]
        directory = self.locate(step)
        if directory is None or not directory.is_dir():
            return None
        from prime_node.ml.engine import TorchEngine
        from prime_node.ml.model import load_model

        engine = TorchEngine(
            load_model(directory),
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            policy_step=step,
        )
        self._loaded[step] = engine
        while len(self._loaded) > self.keep:
            self._loaded.popitem(last=False)
        return engine


class Judge:
    """Validates frames and signs the verdicts that can be attributed to a worker."""

    def __init__(self, validator: BatchValidator, key: WalletKey) -> None:
        self.validator = validator
        self.key = key

    def judge(
        self, frame: bytes, *, now_ms: int, current_step: int
    ) -> tuple[ValidationResult, Envelope | None]:
        """The pipeline's result, and the signed verdict to publish (None when nothing names a worker)."""
        result = self.validator.validate_frame(frame, now_ms=now_ms, current_step=current_step)
        verdict = result.verdict()
        envelope = None if verdict is None else seal_verdict(self.key, verdict, now_ms=now_ms)
        return result, envelope
