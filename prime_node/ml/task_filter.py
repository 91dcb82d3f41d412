"""The offline pass-rate filter: drop tasks a model always or never solves (they give GRPO no signal).

For each training task, ``samples`` completions are drawn with the run's temperature and the seeded
sampling rule (seeds from the schedule hash of a fixed filter worker, so the result is reproducible);
tasks whose mean score lies in [low, high] are written as JSONL lines ``{"task_id", "pass_rate",
"prompt"}``; for file-based tasks each line also carries the task's own record fields, so the output is
itself a valid task file for the next run. It lives in ml/, not tasks/, because it drives an engine:
tasks/ stays below ml/.
"""

from __future__ import annotations

import json
from pathlib import Path

from crypto.keys import Address
from prime_node.atomic_files import atomic_writer
from prime_node.config import RunConfig
from prime_node.ml.engine import SamplingParams
from prime_node.ml.engines import load_engine
from prime_node.ml.evaluation import completion_text, encode_prompt
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.tasks.factory import build_task
from protocol import schedule

FILTER_WORKER = Address(b"\xff" * 20)


def filter_by_pass_rate(
    run: RunConfig,
    model_dir: Path,
    *,
    low: float,
    high: float,
    samples: int,
    limit: int,
    out: Path,
    batch_tasks: int = 32,
) -> tuple[int, int]:
    """Write the kept tasks to ``out``; returns (kept, examined)."""
    task = build_task(run.task)
    tokenizer = load_tokenizer(model_dir)
    engine = load_engine(model_dir, tokenizer, engine=run.engine)
    pool = list(task.train_ids())
    if limit:
        pool = pool[:limit]
    params = SamplingParams(max_new_tokens=run.max_new_tokens, temperature=run.temperature)
    kept = 0
    with atomic_writer(out, text=True) as handle:
        for start in range(0, len(pool), batch_tasks):
            chunk = pool[start : start + batch_tasks]
            prompts, seeds = [], []
            for task_id in chunk:
                encoded = encode_prompt(tokenizer, task.prompt(task_id))
                for j in range(samples):
                    prompts.append(encoded)
                    seeds.append(schedule.sample_seed(FILTER_WORKER, 0, task_id, run.seed, 0, j))
            completions = engine.generate(prompts, seeds, params)
            for i, task_id in enumerate(chunk):
                group = completions[i * samples : (i + 1) * samples]
                rate = (
                    sum(
                        task.score(task_id, completion_text(tokenizer, c.tokens, engine.eos_token_id))
                        for c in group
                    )
                    / samples
                )
                if low <= rate <= high:
                    kept += 1
                    record = task.record(task_id) if hasattr(task, "record") else {}
                    line = {"task_id": task_id, "pass_rate": rate, "prompt": task.prompt(task_id), **record}
                    handle.write(json.dumps(line) + "\n")
    return kept, len(pool)
