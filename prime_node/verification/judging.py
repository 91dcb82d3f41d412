"""The validator's judge as its service drives it from a worker thread: built once, tokenizer read lazily.

``ThreadJudge`` owns the ``Judge`` (verification/judge.py) and its ``PolicyEngines``. When the validator
was given no tokenizer it reads one from the first checkpoint it finds, for the engines and for the
pipeline's cheap stages alike. Every method here blocks (model loads, forward passes): call them through
a worker thread (ValidatorService does, through ``model_threads.run_model_work``: a stopping service
abandons the thread, and ``stop``, checked before each forward pass of every engine, ends its work).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.verification.judge import Judge, PolicyEngines
from prime_node.verification.model_threads import ModelStop
from prime_node.verification.validator import BatchValidator, CheckPolicy, ValidationResult
from protocol.envelope import Domain, Envelope, EnvelopeVerifier, FreshnessWindow

if TYPE_CHECKING:
    from prime_node.config import RunConfig
    from prime_node.ml.engine import TorchEngine
    from prime_node.verification.judge import Judge, PolicyEngines


class ThreadJudge:
    """See the module doc."""

    def __init__(
        self,
        key: WalletKey,
        run_config: RunConfig,
        locate: Callable[[int], Path | None],
        tokenizer: Any,
        *,
        keep: int,
        check_policy: CheckPolicy,
        device: str,
    ) -> None:
        self.key = key
        self.run_config = run_config
        self.locate = locate
        self.tokenizer = tokenizer
        self.keep = keep
        self.check_policy = check_policy
        self.device = device
        self._judge: Judge | None = None
        self._engines: PolicyEngines | None = None
        self.stop = ModelStop()
        """Set when the validator service stops (model_threads.py)."""

    def build(self, domain: Domain, window: FreshnessWindow) -> None:
        from prime_node.tasks.factory import build_task

        self.stop.check()
        run = self.run_config
        self._engines = PolicyEngines(
            self.locate,
            self.tokenizer,
            keep=self.keep,
            engine=run.engine,
            dtype=run.validator_dtype,
            device=self.device,
        )
        validator = BatchValidator(
            run,
            build_task(run.task),
            self.tokenizer,
            self.engine,
            rollout_verifier=EnvelopeVerifier(domain, window),
            policy=self.check_policy,
            device=self.device,
        )
        self._judge = Judge(validator, self.key)

    def engine(self, step: int) -> TorchEngine | None:
        """``PolicyEngines``, once the tokenizer is known (read from the first checkpoint seen when none
        was given)."""
        assert self._engines is not None
        self.stop.check()
        if self.tokenizer is None and not self._load_tokenizer(step):
            return None
        engine = self._engines(step)
        if engine is not None:
            self.stop.guard(engine)
        return engine

    def _load_tokenizer(self, *steps: int) -> bool:
        """Read the tokenizer from the checkpoint of the first of ``steps`` held; False if none is."""
        assert self._engines is not None and self._judge is not None
        for step in steps:
            directory = self.locate(step)
            if directory is None or not directory.is_dir():
                continue

            try:
                self.tokenizer = load_tokenizer(directory)
            except (OSError, ValueError) as exc:
                raise NodeError(
                    f"cannot load the tokenizer in {directory}: {exc}", reason="bad_checkpoint"
                ) from exc
            self._engines.tokenizer = self.tokenizer
            self._judge.validator.tokenizer = self.tokenizer
            return True
        return False

    def judge(
        self, frame: bytes, step: int, now_ms: int, current_step: int
    ) -> tuple[ValidationResult, Envelope | None]:
        assert self._judge is not None
        self.stop.check()
        if self.tokenizer is None:  # the pipeline's cheap stages may need it before any engine is built
            self._load_tokenizer(step, current_step)
        return self._judge.judge(frame, now_ms=now_ms, current_step=current_step)
