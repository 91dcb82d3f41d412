"""A code-task run and a batch whose one hostile group holds programs that write marker files.

The hostile group is built the way a reward inflater would (prime_node/verification/cheating.py,
``inflated_reward``): completions written by hand, with log-probs and TOPLOC proofs recomputed by a
prefill so that every check short of the sampling replay passes. A validator that recomputes a secret
sample of groups (``CheckPolicy.recompute_groups``) accepts it whenever that group is not in its sample;
what matters is then that nobody executes those programs. ``RecordingCodeTask`` is the real code task
(programs run in the real sandbox) that also remembers every completion it was asked to score, so a
test sees an execution even where the sandbox would stop the marker write.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from crypto.digests import blake3
from prime_node.tasks.code import CodeTask
from prime_node.verification.cheating import Scenario, with_completions
from prime_node.verification.validator import BatchValidator
from protocol.rollouts import RolloutBatch

PROBLEMS = 10  # train ids 0..8 (every 10th is held out): enough distinct tasks for 4 groups
GROUPS, GROUP_SIZE, MAX_NEW_TOKENS = 4, 2, 96


class RecordingCodeTask(CodeTask):
    """The code task, remembering each completion it scored (and so executed)."""

    scored: list[str]

    def score(self, task_id: int, completion: str) -> float:
        self.scored.append(completion)
        return super().score(task_id, completion)


def recording(task: CodeTask) -> RecordingCodeTask:
    """``task`` (same problems and limits) as a RecordingCodeTask."""
    problems = [(r["prompt"], r["tests"]) for r in map(task.record, range(PROBLEMS))]
    spy = RecordingCodeTask(problems, timeout_s=task.timeout_s, memory_mb=task.memory_mb, name=task.name)
    spy.scored = []
    return spy


@dataclass
class CodeRun:
    scenario: Scenario
    markers: Path
    """A world-writable directory the hostile programs write into (the sandbox runs as another uid)."""
    hostile: list[str] = field(default_factory=list)

    @property
    def task(self) -> RecordingCodeTask:
        task: RecordingCodeTask = self.scenario.task
        return task

    def executed_hostile(self) -> bool:
        return any(text in scored for text in self.hostile for scored in self.task.scored)


@contextmanager
def marker_dir() -> Iterator[Path]:
    """A world-writable directory under /tmp (pytest's tmp_path is not reachable by the sandbox's uid),
    removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="pn-marker-", dir="/tmp"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def code_run(tmp_path: Path, markers: Path, **run: object) -> CodeRun:
    """A tiny-model scenario on a code task whose every problem asks for ``f()`` returning 1; hostile
    programs write into ``markers``."""
    from prime_node.config import RunConfig
    from prime_node.ml.engines import setup_engine
    from prime_node.ml.model import create_tiny_model

    path = tmp_path / "code.jsonl"
    # No spaces in prompts or programs: the char tokenizer read back from a model directory drops them
    # (the validator here holds the in-memory one, the trainer reads its own from disk).
    rows = [{"prompt": f"Write_f()_returning_1.({i})", "tests": "assert f() == 1\n"} for i in range(PROBLEMS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = RunConfig.model_validate(
        {
            "run_id": "adversary",
            "group_size": GROUP_SIZE,
            "prompts_per_step": GROUPS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 1.0,
            "async_level": 2,
            "seed": 7,
            "task": {"kind": "code", "path": str(path), "code_timeout_s": 10.0},
            **run,
        }
    )
    model, tokenizer = create_tiny_model(0)
    engine = setup_engine(model, tokenizer, engine=config.engine)
    task = recording(CodeTask.from_file(path, timeout_s=10.0))
    return CodeRun(Scenario(config=config, task=task, tokenizer=tokenizer, engine=engine), markers)


def with_hostile_group(run: CodeRun, batch: RolloutBatch, group: int) -> RolloutBatch:
    """``batch`` with group ``group`` replaced: one program that passes the tests and one that fails them,
    both writing a marker file first (so the group is informative: GRPO would train on it)."""
    from prime_node.ml.evaluation import encode_prompt

    scenario = run.scenario
    tokenizer = scenario.tokenizer
    eos = tokenizer.eos_token_id
    texts = [
        f"open('{run.markers}/m{group}{j}','w').write('x')\nf=lambda:{1 - j}\n"
        for j in range(batch.group_size)
    ]
    completions = [[*encode_prompt(tokenizer, text), eos] for text in texts]
    assert all(len(c) <= scenario.config.max_new_tokens for c in completions)
    originals = batch.group(group)
    replaced = with_completions(scenario.engine, originals, completions, batch.temperature)
    run.hostile = [text.split("\n")[0] for text in texts]
    samples = list(batch.samples)
    samples[group * batch.group_size : (group + 1) * batch.group_size] = replaced
    return replace(batch, samples=tuple(samples))


def unsampled_hostile_frame(run: CodeRun, validator: BatchValidator, counter: int = 0) -> tuple[bytes, int]:
    """A sealed frame whose hostile group is outside ``validator``'s secret sample, and that group."""
    batch = run.scenario.batch(counter)
    for attempt in range(8 * batch.groups):
        group = attempt % batch.groups
        hostile = with_hostile_group(run, batch, group)
        frame = run.scenario.seal(hostile)
        sampled = {n // batch.group_size for n in validator.recomputed_samples(hostile, blake3(frame))}
        if group not in sampled:
            return frame, group
        run.scenario.now_ms += 1  # another nonce and time: another frame id, another secret draw
    raise AssertionError("every frame put the hostile group in the validator's sample")
