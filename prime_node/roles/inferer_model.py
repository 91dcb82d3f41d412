"""The inferer's model work, apart from its demand-driven batch loop: load, switch, make a batch's frames.

``InfererModel`` loads the newest policy into an engine (``ml.engines.load_engine``; with the torch
threads the node gives its role: ``--threads``) on the device the role runner chose
(``hardware.select_device``), switches it to newer weights, and has its ``RolloutProducer`` turn the
policy into a batch's signed frames; every method runs in a worker thread (inferer_service.py decides when),
and ends at its next check of ``stop`` (before each forward pass) once the service has stopped.

On a GPU it plans memory before loading (``ml/vram_plan.py``): a run batch that does not fit is generated
in smaller chunks (the samples stay the same: each is seeded on its own), a model that does not fit at
all is refused with the numbers. Generation runs through ``ml/oom_retry.py``'s ``ChunkedEngine``, which
halves the chunk on an out-of-memory error: a batch is published whole or not at all.

What it publishes for each batch comes from a ``RolloutProducer``: ``HonestProducer`` unless whoever
builds the service passes another one — the demo's cheating inferer passes a ``CheatingProducer``
(prime_node/verification/cheating.py), whose every batch validators must reject.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.ml.engines import load_engine
from prime_node.ml.evaluation import encode_prompt
from prime_node.ml.oom_retry import ChunkedEngine
from prime_node.ml.rollout_batch import make_batch, with_tied_head
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.ml.vram_plan import GenerationSettings, model_shape, plan_generation
from prime_node.node.stage_times import StageTimes
from prime_node.tasks.factory import build_task
from prime_node.verification.model_threads import ModelStop
from prime_node.verification.proofs import build_proofs
from prime_node.verification.proving import seal_batch
from protocol.codec import encode

if TYPE_CHECKING:
    from prime_node.ml.engine import InferenceEngine
    from prime_node.ml.vram_plan import VramPlan
    from prime_node.tasks.base import TaskSource

log = logging.getLogger(__name__)

PROMPT_SAMPLE = 256
"""Train prompts measured for the VRAM plan's prompt length (a longer one is left to the OOM retry)."""


def longest_prompt(task: TaskSource, tokenizer: Any, sample: int = PROMPT_SAMPLE) -> int:
    """Tokens in the longest of the task's first ``sample`` train prompts."""

    ids = task.train_ids()[:sample]
    return max((len(encode_prompt(tokenizer, task.prompt(i))) for i in ids), default=1)


class RolloutProducer(Protocol):
    """Turns the policy an inferer holds into the signed frames it gossips for one batch counter.

    Called in a worker thread. ``adversary`` names the attack a cheating producer makes (None when
    honest), for the status section."""

    @property
    def adversary(self) -> str | None: ...

    def frames(
        self,
        *,
        engine: InferenceEngine,
        tokenizer: Any,
        task: TaskSource,
        policy_step: int,
        counter: int,
        now_ms: int,
    ) -> list[bytes]: ...


class HonestProducer:
    """The scheduled batch with its TOPLOC proofs, sealed with the worker's key: one frame per counter.

    Times each stage (generate, prove, sign) into ``stages``."""

    adversary: str | None = None

    def __init__(self, *, key: WalletKey, run_config: RunConfig, stages: StageTimes) -> None:
        self.key = key
        self.config = run_config
        self.stages = stages

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
        import torch

        proving = 0.0

        def timed_proofs(hiddens: list[torch.Tensor]) -> list[bytes]:
            nonlocal proving
            began = time.perf_counter()
            try:
                return build_proofs(hiddens)
            finally:
                proving = time.perf_counter() - began

        began = time.perf_counter()
        batch = make_batch(
            engine,
            task,
            tokenizer,
            self.config,
            worker=self.key.address,
            policy_step=policy_step,
            batch_counter=counter,
            prove=timed_proofs,
        )
        made = time.perf_counter()
        frame = encode(seal_batch(self.key, batch, now_ms=now_ms))
        self.stages.add("generate", made - began - proving)
        self.stages.add("prove", proving)
        self.stages.add("sign", time.perf_counter() - made)
        return [frame]


class InfererModel:
    """The engine, tokenizer and task of one inferer (module doc); ``free_vram`` gives a CUDA device's free
    memory for the VRAM plan (tests pass synthetic sizes)."""

    def __init__(
        self,
        run_config: RunConfig,
        *,
        producer: RolloutProducer,
        device: str,
        threads: int,
        free_vram: Callable[[str], int],
    ) -> None:
        self.config = run_config
        self.producer = producer
        self.device = device
        self.threads = threads
        self.free_vram = free_vram
        self.vram_plan: VramPlan | None = None
        self.engine: Any = None
        self.tokenizer: Any = None
        self.task: Any = None
        self.stop = ModelStop()
        """Set when the service stops: abandoned work ends at its next token (verification/model_threads)."""

    def load(self, step: int, path: Path) -> None:
        import torch

        self.stop.check()
        torch.set_num_threads(self.threads)  # torch keeps the count per OS thread
        self.tokenizer = load_tokenizer(path)
        self.task = build_task(self.config.task)
        config = self.config
        max_batch = None
        if self.device.startswith("cuda"):  # plan before loading: refuse or shrink, never crash mid-run
            self.vram_plan = self.plan_vram(path)
            max_batch = self.vram_plan.require()
            log.info("inferer VRAM plan: %s", self.vram_plan.describe())
        engine = load_engine(
            path,
            self.tokenizer,
            engine=config.engine,
            dtype=config.inference_dtype,
            device=self.device,
            policy_step=step,
        )
        self.engine = ChunkedEngine(engine, max_batch=max_batch)
        self.stop.guard(self.engine)

    def plan_vram(self, path: Path) -> VramPlan:
        """The generation plan for the model in ``path`` on this inferer's device (``ml/vram_plan.py``)."""

        settings = GenerationSettings(
            batch=self.config.samples_per_step,
            prompt_tokens=longest_prompt(self.task, self.tokenizer),
            max_new_tokens=self.config.max_new_tokens,
            dtype=self.config.inference_dtype,
        )
        return plan_generation(model_shape(path), settings, self.free_vram(self.device), device=self.device)

    def switch(self, step: int, path: Path) -> None:
        from prime_node.ml.checkpoint import read_weights

        self.stop.check()
        weights = read_weights(path)
        self.engine.load_weights(with_tied_head(self.engine.model, weights), step)

    def frames(self, policy_step: int, counter: int, now_ms: int) -> list[bytes]:
        import torch

        self.stop.check()
        torch.set_num_threads(self.threads)  # torch keeps the count per OS thread
        return self.producer.frames(
            engine=self.engine,
            tokenizer=self.tokenizer,
            task=self.task,
            policy_step=policy_step,
            counter=counter,
            now_ms=now_ms,
        )
