"""Each rank of the networked trainer under torchrun (DESIGN §6, §8): the entry point torchrun starts.

Rank 0 is the whole node, exactly as with one process: libp2p host, gossip, admission, weight swarm,
status API and the trainer key (received from the launcher, ``trainer_launcher.py``). Ranks > 0 hold no
network and no key: they build the same ``TrainingSession`` and ``follow`` it; every admitted step's batch
reaches them inside rank 0's ``session.train`` and they take the step with it, until rank 0's
``session.close`` stops them.

Across machines every rank checks, before training, that it runs rank 0's run config and sees rank 0's
output directory (DCP shards and checkpoints are written by every rank into one directory, so it must be
storage every node shares).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from prime_node.errors import NodeError
from prime_node.parent_death import death_signal_setter
from prime_node.roles.trainer_launcher import ENTRY_MODULE, LaunchSpec, receive_key

if TYPE_CHECKING:
    from prime_node.ml.distributed import DistInfo
    from prime_node.ml.trainer import StepMetrics

log = logging.getLogger(__name__)


# -- every rank ------------------------------------------------------------------------------------------


def run_rank(directory: Path, dist: DistInfo) -> bool:
    """Rank 0: the node (until a signal, or max_steps with exit_when_done). Ranks > 0: follow it.
    True when every rank left the session together (they may meet in a last barrier)."""
    spec = LaunchSpec.read(directory)
    from prime_node.ml.distributed import check_same_run, spans_machines

    if spans_machines(dist):
        check_same_run(spec.run, dist)
    if dist.is_main:
        return _run_node(spec, directory, dist)
    return _follow(spec, dist)


def _run_node(spec: LaunchSpec, directory: Path, dist: DistInfo) -> bool:
    from prime_node.roles.trainer_node import build_trainer_node, run_trainer_node, step_line

    key = receive_key(directory)

    def echo(line: str) -> None:
        print(line, flush=True)

    parts = build_trainer_node(
        spec.node,
        spec.run,
        key,
        dataplane_host=spec.dataplane_host,
        dataplane_port=spec.dataplane_port,
        on_step=lambda metrics: echo(step_line(metrics)),
        dist=dist,
    )
    run_trainer_node(spec.node, parts, key, echo=echo, exit_when_done=spec.exit_when_done)
    return bool(parts.trainer.stopped_ranks)


def _follow(spec: LaunchSpec, dist: DistInfo) -> bool:
    """Train every step rank 0 broadcasts; one JSON line per step on stderr (which rank took which)."""
    from prime_node.ml.session import TrainingSession

    for sig in (signal.SIGINT, signal.SIGTERM):
        # Rank 0 stops this rank through the session once its step is done (and gloo fails here if
        # rank 0 is gone); torchrun SIGKILLs a rank that outlives its stop deadline.
        signal.signal(sig, signal.SIG_IGN)
    assert spec.run.model_dir is not None  # the launcher checked
    session = TrainingSession(spec.run, base=spec.run.model_dir, dist=dist)

    def say(line: dict[str, object]) -> None:
        print(json.dumps({"rank": dist.rank, **line}), file=sys.stderr, flush=True)

    say({"pid": os.getpid(), "following_from_step": session.step})

    def on_step(metrics: StepMetrics) -> None:
        say(
            {
                "step": metrics.step,
                "policy_step": metrics.policy_step,
                "groups_kept": metrics.groups_kept,
                "reward": metrics.reward_mean,
                "loss": metrics.loss,
                "grad_norm": metrics.grad_norm,
            }
        )

    try:
        session.follow(on_step)
    finally:
        session.close()
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=ENTRY_MODULE)
    parser.add_argument("--launch-dir", type=Path, required=True)
    parser.add_argument("--gpu", default="auto", help="run-trainer --gpu: auto, none or indices (0,1)")
    args = parser.parse_args(argv)
    level = os.environ.get("PRIME_NODE_LOG_LEVEL", "warning").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from crypto.errors import CryptoError
    from prime_node.ml.distributed import init_from_env, shutdown
    from protocol.errors import ProtocolError

    # torchrun gives each rank a process group of its own: if torchrun itself is killed, its ranks
    # should not live on. Rank 0 stops as on SIGTERM; the others hold nothing worth a clean exit.
    rank = int(os.environ.get("RANK", "0"))
    set_death_signal = death_signal_setter(signal.SIGTERM if rank == 0 else signal.SIGKILL)
    if set_death_signal is not None:
        set_death_signal()
        if os.getppid() == 1:  # torchrun died before the request took effect
            return 1
    try:  # this rank's device: select_device for its LOCAL_RANK (a missing GPU is a clear error)
        from prime_node.hardware import parse_gpu_selection

        dist = init_from_env(parse_gpu_selection(args.gpu))
    except NodeError as exc:
        print(f"error: trainer rank {rank}: {exc}", file=sys.stderr)
        return 1
    try:
        together = run_rank(args.launch_dir, dist)
    except (NodeError, CryptoError, ProtocolError) as exc:
        print(f"error: trainer rank {dist.rank}: {exc}", file=sys.stderr)
        together, code = False, 1
    except KeyboardInterrupt:
        together, code = False, 130
    except RuntimeError as exc:  # torch.distributed's errors (e.g. gloo: "Connection closed by peer")
        log.debug("trainer rank %d failed", dist.rank, exc_info=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: trainer rank {dist.rank}: {first}", file=sys.stderr)
        together, code = False, 1
    except BaseException as exc:
        lost = _collective_error(exc)
        if lost is None:
            traceback.print_exc()
        else:  # the node's nursery wraps the step's error: say it in one line, as above
            log.debug("trainer rank %d failed", dist.rank, exc_info=True)
            print(
                f"error: trainer rank {dist.rank}: a collective failed (a rank is gone?): {lost}",
                file=sys.stderr,
            )
        together, code = False, 1
    else:
        code = 0
    try:
        shutdown(together=together)
    except Exception as exc:  # a rank that left without the last barrier: torchrun reports which
        print(f"error: trainer rank {dist.rank}: leaving the process group failed: {exc}", file=sys.stderr)
        code = code or 1
    return code


def _collective_error(exc: BaseException) -> str | None:
    """The first line of the torch.distributed error (a RuntimeError) at the bottom of an exception
    group, or None when the group holds something else: that deserves its whole traceback."""
    if not isinstance(exc, BaseExceptionGroup):
        return None
    runtime, rest = exc.split(RuntimeError)
    if runtime is None or rest is not None:
        return None
    leaf: BaseException = runtime
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    text = str(leaf).strip()
    return text.splitlines()[0] if text else type(leaf).__name__


if __name__ == "__main__":
    from prime_node.ml.distributed import exit_process

    exit_process(main())
