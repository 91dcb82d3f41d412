"""``run-trainer`` prints each held-out evaluation as it lands (issue 36: they came all together after the
last step). The real process's lines are checked in tests/ml/test_cli.py; here the timing, on trio's
virtual clock, with a stand-in for the trainer's two fields the reporter reads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import trio
import trio.testing

from prime_node.roles.trainer_node import echo_evaluations


@dataclass
class _Trainer:
    held_out: list[list[float]] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)


async def test_each_evaluation_is_printed_when_it_lands_and_the_final_one_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    trainer, lines = _Trainer(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo_evaluations, trainer, lines.append)
        await trio.sleep(30)
        assert lines == []
        trainer.held_out.append([0, 0.25])
        await trio.sleep(5)
        assert [json.loads(line) for line in lines] == [{"eval_step": 0, "heldout_greedy_accuracy": 0.25}]
        trainer.held_out.append([10, 0.5])
        await trio.sleep(5)
        assert len(lines) == 2  # during training, not after it
        trainer.held_out.append([20, 0.75])  # the final evaluation, then done at once
        trainer.done.set()
    assert [json.loads(line)["eval_step"] for line in lines] == [0, 10, 20]
