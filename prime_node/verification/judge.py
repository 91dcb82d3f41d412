"""The validator role without the network: policies by step, and judging a frame into a signed verdict.

A node service (trio) wraps ``Judge``: it feeds it the rollout frames it fetches, runs ``judge`` in a
worker thread, and publishes the returned verdict envelope. ``PolicyEngines`` is the ``engines(step)``
a ``BatchValidator`` asks for: it loads each policy step from the checkpoint directory the node
already holds (Hugging Face layout, safetensors only) and keeps the most recent few in memory.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.ml.engines import DEFAULT_DTYPE, DEFAULT_ENGINE, engine_spec, load_engine
from prime_node.ml.model import check_model_dir
from prime_node.verification.validator import BatchValidator, ValidationResult
from protocol.envelope import Envelope
from protocol.verdict import seal_verdict

if TYPE_CHECKING:
    from prime_node.ml.engine import TorchEngine


class PolicyEngines:
    """``engines(step)``: an engine holding policy ``step``, or None when no checkpoint for it exists.

    ``locate(step)`` names the step's model directory (or None); at most ``keep`` engines stay loaded,
    the least recently used is dropped first. A new policy arrives every trainer step, so once ``keep``
    engines exist the dropped one's model is reused: the new step's safetensors weights are loaded into
    it (a strict ``load_state_dict``), which is far cheaper than building a model with
    ``from_pretrained``. Only the first ``keep`` policies, or a checkpoint whose ``config.json`` differs
    from the model's, build a model. ``builds`` counts those. ``engine`` is the run's engine family,
    ``device`` where the engines compute (``prime_node.hardware.select_device``).
    """

    def __init__(
        self,
        locate: Callable[[int], Path | None],
        tokenizer: Any,
        *,
        keep: int = 3,
        engine: str = DEFAULT_ENGINE,
        dtype: str = DEFAULT_DTYPE,
        device: str = "cpu",
    ) -> None:
        if keep < 1:
            raise ValueError("keep at least one policy")
        engine_spec(engine, dtype)  # an unknown family or dtype fails here, not at the first batch
        self.dtype = dtype
        self.device = device
        self.locate = locate
        self.tokenizer = tokenizer
        self.keep = keep
        self.engine = engine
        self.builds = 0
        self._loaded: OrderedDict[int, TorchEngine] = OrderedDict()
        self._configs: dict[int, Any] = {}  # id(engine) → the parsed config.json it was built from

    def __call__(self, step: int) -> TorchEngine | None:
        if step in self._loaded:
            self._loaded.move_to_end(step)
            return self._loaded[step]
        directory = self.locate(step)
        if directory is None or not directory.is_dir():
            return None
        config = _read_config(directory)
        oldest = next(iter(self._loaded.values()), None)
        if (
            len(self._loaded) >= self.keep
            and oldest is not None
            and config is not None
            and (self._configs[id(oldest)] == config)
        ):
            self._loaded.popitem(last=False)
            del self._configs[id(oldest)]
            engine = self._reload(oldest, directory, step)
        else:
            engine = self._build(directory, step)
        self._configs[id(engine)] = config
        self._loaded[step] = engine
        while len(self._loaded) > self.keep:
            _, dropped = self._loaded.popitem(last=False)
            self._configs.pop(id(dropped), None)
        return engine

    def _build(self, directory: Path, step: int) -> TorchEngine:
        engine = load_engine(
            directory,
            self.tokenizer,
            engine=self.engine,
            dtype=self.dtype,
            device=self.device,
            policy_step=step,
        )
        self.builds += 1
        return engine

    def _reload(self, engine: TorchEngine, directory: Path, step: int) -> TorchEngine:
        """``engine`` holding the weights of ``directory`` (the engine is dropped if they do not load)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from prime_node.ml.rollout_batch import with_tied_head

        check_model_dir(directory)
        try:
            weights: dict[str, Any] = {}
            for path in sorted(directory.glob("*.safetensors")):
                weights.update(load_file(str(path)))
            engine.load_weights(with_tied_head(engine.model, weights), step)
        except (OSError, SafetensorError, RuntimeError, KeyError, ValueError) as exc:
            raise NodeError(f"cannot load a model from {directory}: {exc}", reason="bad_model_dir") from exc
        engine.eos_token_id = self.tokenizer.eos_token_id
        engine.pad_token_id = self.tokenizer.pad_token_id
        return engine


def _read_config(directory: Path) -> Any:
    """The parsed config.json of a model directory, or None when there is none to read (a fresh build
    then reports the problem)."""
    try:
        return json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


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
