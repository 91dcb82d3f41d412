"""The whole loop at size (issue 32): a networked trainer, one inferer and one validator on this machine.

For each world size in ``--ranks`` (default 1,2) the demo's own helpers (``create_wallets``,
``demo_run_config``, ``trainer_command``, ``joiner_command``, ``Supervisor``) start ``prime-node
run-trainer --nproc N`` (networked; FSDP2 over gloo when N > 1), one ``prime-node join --role validator``
and one ``--role inferer`` on 127.0.0.1; the run config names the trainer and trusts the validator. The
model is ``init-model --arch qwen3 --size 0.6b --vocab 4096`` (Qwen3-0.6B's shape with a 4,096-token
vocabulary, so the embedding does not dominate on a CPU: 444.7M parameters, bf16) or ``--model-dir``.

A random model never ends a completion (EOS is 1 token in 4,096) and solves no task, so every group's
rewards would be equal and nothing would train. The model made here is "EOS-calibrated": EOS's row of
the output embedding becomes a random direction whose length is solved, on the model's own logits, for
a sampled token to be EOS with probability ``--eos-p``; with a length reward (target ``max_new_tokens //
2``) completions of different lengths earn different rewards. Every parameter and cost is the model's.

Sized to finish: one prompt of ``--group`` samples a step, ``--max-new-tokens``, ``--lr`` (1e-6, an RL
rate for this size: a bf16 policy then changes ~1 % of its values a step), ``async_level`` 1, no
evaluation, ``--threads`` per process. ``max_steps`` is ``--steps`` + 1 and the run is stopped once
``--steps`` are trained and both workers hold the last policy: at ``max_steps`` the trainer would load
an evaluation engine (even with ``eval_tasks = 0``), and ``--exit-when-done`` would take the only seed
of the last policy away.

Measured: ``policy_steps_trained`` (``OUT/metrics.jsonl``); each process's peak RSS (``VmHWM``, polled;
torchrun's ranks are the trainer's descendants) and ``rss_per_rank_ratio`` = a rank's peak when the last
step was trained ÷ (16 B × params ÷ ranks); the session's step timers (``TrainingSession.times``, which no
status reports: a ``sitecustomize`` probe on the children's ``PYTHONPATH`` appends them to a file after
each ``TrainingSession._step``, changing nothing else), hence ``checkpoint_share`` (checkpoint seconds on
the step's path ÷ the session step, as ``benchmarks/trainer.py``; ``_of_loop``: ÷ the loop's s/step);
every node's status each second (stage timers, the trainer's ``time_s`` and ``publishing``, and which
checkpoint versions each node holds: ``policy_transfer`` = inferer holds step N complete − trainer seeds
it); the trainer's log (a delta announced after its full version: its encode time); ``write_bytes`` of
the trainer's processes (``/proc/PID/io``) per step; after the run, the last two published policies
encoded and applied again with ``prime_node.swarm.delta_codec`` (no node reports an apply time) and
checked byte for byte. Verified: the workers accept only trainer-signed manifests and hash-checked
pieces; the benchmark checks each held every published step and that ``bad_deltas`` is 0.

Prints ONE JSON line; exits non-zero after it if a world size trained fewer than 3 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prime_node.config import load_run_config  # noqa: E402
from prime_node.demo.orchestrator import child_env, fetch, read_node_file, stop_signals_raise  # noqa: E402
from prime_node.demo.setup import (  # noqa: E402
    DemoPlan,
    NodeSpec,
    cli,
    create_wallets,
    demo_run_config,
    joiner_command,
    toml_text,
    trainer_command,
)
from prime_node.demo.supervisor import Child, Supervisor  # noqa: E402

BYTES_PER_PARAM = 16  # fp32 weights + gradients + both AdamW moments
RSS_GOAL = 1.3
MIN_STEPS = 3
POLL_S = 1.0
SAMPLE_S = 0.5
GRACE_S = 240.0
"""After the last trained step: how long the workers get to hold the last policy."""
MIB = 2**20
HEADLINE = frozenset(
    {
        "rss_per_rank_ratio",
        "peak_rss_mib",
        "peak_rss_mib_at_last_step",
        "checkpoint_share",
        "checkpoint_share_of_loop",
        "delta_encode_gb_per_s",
        "delta_offline",
        "step_s",
        "parts_s",
        "bytes_written_per_step",
        "verified",
        "policy_steps_trained",
        "gb_per_s",
    }
)
"""Per-world-size figures the summary lists under their own keys (the rest go under ``details_by_ranks``)."""

PROBE = r'''
"""benchmarks/scale.py's probe: after each TrainingSession._step, append the session's timers."""
import importlib.machinery
import json
import os
import sys
import time

_OUT = os.environ.get("SCALE_PROBE_DIR")


def _write(line):
    with open(os.path.join(_OUT, "session-%d.jsonl" % os.getpid()), "a") as handle:
        handle.write(json.dumps(line) + "\n")


def _patch(module):
    cls = module.TrainingSession
    step, init = cls._step, cls.__init__

    def _init(self, *args, **kwargs):
        began = time.time()
        init(self, *args, **kwargs)
        _write({"rank": self.dist.rank, "opened_s": time.time() - began, "ended": time.time()})

    def _step(self, merged, *, save, stage):
        began = time.time()
        metrics = step(self, merged, save=save, stage=stage)
        _write({"rank": self.dist.rank, "step": metrics.step, "began": began, "ended": time.time(),
                "save": save, "times": dict(self.times), "last_save_s": self._saver.last_seconds})
        return metrics

    cls.__init__, cls._step = _init, _step


class _Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "prime_node.ml.session":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                _patch(module)
            except Exception as exc:  # a changed session: measure nothing rather than break the run
                print("scale probe: not installed: %r" % (exc,), file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


if _OUT:
    sys.meta_path.insert(0, _Finder)
'''


# -- the model --------------------------------------------------------------------------------------------


def make_model(size: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``init-model`` then the EOS calibration, each in its own process (this one stays small)."""
    command = [*cli(), "init-model", "--arch", "qwen3", "--size", size, str(out), "--json"]
    if size == "0.6b":
        command[-2:-2] = ["--vocab", "4096"]
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"init-model failed: {done.stderr[-2000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    info["init_s"] = round(time.monotonic() - began, 1)
    calibrate = [
        sys.executable,
        __file__,
        *("--calibrate-eos", str(out), "--eos-p", str(args.eos_p), "--temperature", str(args.temperature)),
        *("--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed)),
    ]
    done = subprocess.run(calibrate, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"EOS calibration failed: {done.stderr[-2000:]}")
    info["eos_calibration"] = json.loads(done.stdout.strip().splitlines()[-1])
    _calibration_file(out).write_text(json.dumps(info))
    return info


def _calibration_file(model_dir: Path) -> Path:
    return model_dir.parent / f"{model_dir.name}.scale.json"


def calibrate_eos(model_dir: Path, target_p: float, temperature: float, tokens: int, seed: int) -> None:
    """Set EOS's output-embedding row to ``alpha * u`` (u a random unit vector) with alpha chosen so that,
    on random continuations of the task's prompts, the mean probability of sampling EOS at a position is
    ``target_p``. Rewrites the safetensors file holding that row; prints one JSON line."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from prime_node.config.run import TaskConfig
    from prime_node.ml.evaluation import encode_prompt
    from prime_node.ml.tokenizer import load_tokenizer
    from prime_node.tasks.factory import build_task

    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = load_tokenizer(model_dir)
    eos = int(tokenizer.eos_token_id)
    files = sorted(model_dir.glob("*.safetensors"))
    holder, name = None, None
    for wanted in ("lm_head.weight", "model.embed_tokens.weight"):
        for path in files:
            with safe_open(str(path), "pt") as handle:
                if wanted in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    holder, name = path, wanted
                    break
        if holder is not None:
            break
    if holder is None or name is None:
        raise SystemExit(f"no output embedding in {model_dir}")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    head = model.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(head.shape[1], generator=generator)
    direction /= direction.norm()
    with torch.no_grad():
        head[eos] = direction  # the EOS logit is now h·u: alpha * h·u once the row is alpha * u
    task = build_task(TaskConfig.model_validate({"kind": "arithmetic", "digits": 2, "reverse_answer": True}))
    vocab = head.shape[0]
    dots, others = [], []
    with torch.no_grad():
        for task_id in range(8):
            prompt = encode_prompt(tokenizer, task.prompt(task_id))
            tail = torch.randint(0, vocab, (tokens,), generator=generator).tolist()
            ids = torch.tensor([prompt + [t if t != eos else 0 for t in tail]])
            logits = model(ids).logits[0, len(prompt) - 1 :].float()
            dots.append(logits[:, eos].clone())
            logits[:, eos] = float("-inf")
            others.append(torch.logsumexp(logits / temperature, dim=-1))
    dot, rest = torch.cat(dots), torch.cat(others)

    def eos_p(alpha: float) -> float:
        return float(torch.sigmoid(alpha * dot / temperature - rest).mean())

    alpha = 0.0
    while eos_p(alpha) < target_p and alpha < 1e4:
        alpha = max(2 * alpha, 0.01)
    low, high = alpha / 2, alpha
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if eos_p(middle) < target_p else (low, middle)
    alpha = high
    weights = load_file(str(holder))
    before = float(weights[name][eos].float().norm())
    weights[name][eos] = (alpha * direction).to(weights[name].dtype)
    save_file(weights, str(holder), metadata={"format": "pt"})
    print(
        json.dumps(
            {
                "eos_token_id": eos,
                "tensor": name,
                "alpha": round(alpha, 4),
                "eos_p": round(eos_p(alpha), 4),
                "row_norm_before": round(before, 4),
                "positions": int(dot.numel()),
                "temperature": temperature,
            }
        )
    )


def model_params(model_dir: Path) -> int:
    """Parameters stored in the safetensors files (headers only; a tied head is stored once)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


# -- processes: peak memory and bytes written ------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return None


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a process, None if it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _parents() -> dict[int, tuple[int, int]]:
    """Every process: pid -> (parent pid, start time)."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            found[int(entry.name)] = stat
    return found


def _status_kib(pid: int) -> dict[str, int]:
    text = _read(f"/proc/{pid}/status") or ""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            values[key] = int(rest.split()[0])
    return values


def _write_bytes(pid: int) -> int | None:
    text = _read(f"/proc/{pid}/io")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return None


class Sampler(threading.Thread):
    """Polls every descendant of the supervisor's children: peak RSS and bytes written, by label."""

    def __init__(self, supervisor: Supervisor, ranks: int) -> None:
        super().__init__(name="scale-sampler", daemon=True)
        self.supervisor, self.ranks = supervisor, ranks
        self.labels: dict[int, str] = {}
        self.started: dict[int, int] = {}
        """pid -> start time: a pid is only ever signalled while it is still that process."""
        self.peak_kib: dict[str, int] = {}
        self.written: dict[int, int] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def _label(self, pid: int, child: Child) -> str:
        if pid == child.pid:
            return "trainer_rank0" if child.name == "trainer" and self.ranks == 1 else child.name
        command = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ")
        if "torch.distributed.run" in command:
            return "torchrun"
        if "prime_node.roles.trainer_ranks" in command:
            environ = (_read(f"/proc/{pid}/environ") or "").split("\0")
            rank = next((item[5:] for item in environ if item.startswith("RANK=")), "?")
            return f"trainer_rank{rank}"
        return f"{child.name}-child-{pid}"

    def sample(self) -> None:
        parents = _parents()
        with self.lock:
            for child in list(self.supervisor.children):
                family, frontier = {child.pid}, [child.pid]
                while frontier:
                    parent = frontier.pop()
                    for pid, (ppid, _) in parents.items():
                        if ppid == parent and pid not in family:
                            family.add(pid)
                            frontier.append(pid)
                for pid in family:
                    if pid not in parents:
                        continue
                    label = self.labels[pid] = self._label(pid, child)  # again: a fork may not have exec'd
                    self.started.setdefault(pid, parents[pid][1])
                    hwm = _status_kib(pid).get("VmHWM")
                    if hwm is not None:
                        self.peak_kib[label] = max(self.peak_kib.get(label, 0), hwm)
                    written = _write_bytes(pid)
                    if written is not None:
                        self.written[pid] = max(self.written.get(pid, 0), written)

    def trainer_bytes(self) -> int:
        with self.lock:
            return sum(
                value
                for pid, value in self.written.items()
                if self.labels.get(pid, "").startswith(("trainer", "torchrun"))
            )

    def peaks_mib(self) -> dict[str, float]:
        with self.lock:
            return {label: round(kib / 1024, 1) for label, kib in sorted(self.peak_kib.items())}

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.sample()

    def kill_leftovers(self) -> None:
        """SIGKILL every process this run started that is still running (same pid and start time)."""
        with self.lock:
            started = dict(self.started)
        for pid, start in started.items():
            now = _stat(pid)
            if now is not None and now[1] == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


# -- one world size ---------------------------------------------------------------------------------------


def _run_config(plan: DemoPlan, args: argparse.Namespace, output: Path) -> dict[str, Any]:
    config = demo_run_config(
        model_dir=plan.model_dir,
        output_dir=output,
        trainer_address=plan.trainer.address,
        validator_addresses=[node.address for node in plan.of_role("validator")],
        steps=args.steps + 1,  # stopped after --steps: see the module doc
        seed=args.seed,
    )
    config.update(
        group_size=args.group,
        prompts_per_step=1,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_schedule="constant",
        async_level=1,
        eval_every=0,
        eval_tasks=0,
        threads=args.threads,
        length_reward={"coef": 1.0, "target_tokens": max(1, args.max_new_tokens // 2)},
        checkpoint_every=args.checkpoint_every
        if args.checkpoint_every == "auto"
        else int(args.checkpoint_every),
        activation_checkpointing=args.activation_checkpointing,
    )
    return config


def _with_threads(command: list[str], threads: int) -> list[str]:
    command = list(command)
    if "--threads" in command:
        command[command.index("--threads") + 1] = str(threads)
    return [*command, "--gpu", "none"]


def _versions(snapshot: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not snapshot:
        return []
    return list(snapshot.get("sections", {}).get("checkpoints", {}).get("versions", []))


def _section(snapshot: dict[str, Any] | None, name: str) -> dict[str, Any]:
    if not snapshot:
        return {}
    return dict(snapshot.get("sections", {}).get(name, {}))


def _metrics_lines(output: Path) -> list[dict[str, Any]]:
    try:
        text = (output / "metrics.jsonl").read_text()
    except OSError:
        return []
    lines = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            lines.append(json.loads(line))
    return lines


def _probe_lines(probe: Path) -> list[dict[str, Any]]:
    lines = []
    for path in sorted(probe.glob("session-*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
    return lines


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


SHARING = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ prime_node\.swarm\.service: sharing step (\d+) as \w+ "
    r"\((\d+) pieces; (\w+)(?:, (\d+) of (\d+) bytes)?\)"
)
DELTA_WAIT_S = 5.0
"""swarm/publishing.py's DELTA_WAIT: how long publish waits for a delta before announcing the full one."""


def _announcements(log: Path) -> list[dict[str, Any]]:
    """The trainer's "sharing step N as ..." log lines: when, which step, why, how many bytes."""
    from datetime import datetime

    found = []
    text = log.read_text(errors="replace") if log.is_file() else ""
    for line in text.splitlines():
        match = SHARING.match(line)
        if match:
            when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append(
                {
                    "t": when,
                    "step": int(match.group(2)),
                    "reason": match.group(4),
                    "delta_bytes": int(match.group(5)) if match.group(5) else None,
                }
            )
    return found


def _late_deltas(announced: list[dict[str, Any]]) -> list[float]:
    """Per step announced first in full (its delta not ready within DELTA_WAIT) and then as a delta: the
    delta's encode time, estimated as the gap between the two announcements plus DELTA_WAIT."""
    full_at = {a["step"]: a["t"] for a in announced if a["reason"] == "encoding"}
    return [
        round(a["t"] - full_at[a["step"]] + DELTA_WAIT_S, 1)
        for a in announced
        if a["reason"] == "delta" and a["step"] in full_at
    ]


def _rebuilt_steps(log: Path) -> list[int]:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return sorted({int(m) for m in re.findall(r"step (\d+) rebuilt from delta", text)})


class World:
    """One run at one world size: start, watch, stop, measure."""

    def __init__(self, ranks: int, args: argparse.Namespace, model_dir: Path, root: Path) -> None:
        self.ranks, self.args, self.model_dir = ranks, args, model_dir
        self.workdir = root / f"ranks{ranks}"
        self.workdir.mkdir(parents=True)
        self.probe = self.workdir / "probe"
        self.probe.mkdir()
        (self.probe / "sitecustomize.py").write_text(PROBE)
        nodes = create_wallets(self.workdir, inferers=1, validators=1, adversary=None)
        self.plan = DemoPlan(self.workdir, tuple(nodes), args.steps + 1, model_dir)
        self.output = self.plan.trainer.data_dir / "output"
        config = _run_config(self.plan, args, self.output)
        self.plan.run_config_path.write_text(toml_text(config), encoding="utf-8")
        load_run_config(self.plan.run_config_path, environ={})  # a bad field fails here, not in a child
        self.snapshots: dict[str, dict[str, Any] | None] = {node.name: None for node in nodes}
        self.held_at: dict[str, dict[int, float]] = {node.name: {} for node in nodes}
        self.kinds: dict[str, dict[int, set[str]]] = {node.name: {} for node in nodes}
        self.step_seen_at: dict[int, float] = {}
        self.bytes_at_step: dict[int, int] = {}
        self.error: str | None = None
        self.peak_at_last_step: dict[str, float] = {}
        self.trainer_up_s: float | None = None
        self.full_bytes = 0

    def env(self) -> dict[str, str]:
        env = child_env()
        threads = str(self.args.threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.probe), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env["SCALE_PROBE_DIR"] = str(self.probe)
        return env

    def run(self) -> dict[str, Any]:
        began = time.monotonic()
        with Supervisor(self.env(), stop_deadline_s=60.0) as supervisor:
            sampler = Sampler(supervisor, self.ranks)
            sampler.start()
            try:
                self._drive(supervisor, sampler, began)
            except RunFailedError as exc:
                self.error = str(exc).splitlines()[0]
                say(f"ranks {self.ranks}: {exc}")
            finally:
                sampler.stop.set()
                sampler.join(timeout=10)
                sampler.sample()
                supervisor.stop_all()
                sampler.kill_leftovers()  # anything of ours the process groups did not reach (torchrun's)
        return self._result(sampler, time.monotonic() - began)

    def _start(self, supervisor: Supervisor, node: NodeSpec, argv: list[str]) -> Child:
        return supervisor.start(node.name, argv, node.log_path)

    def _drive(self, supervisor: Supervisor, sampler: Sampler, began: float) -> None:
        args, plan = self.args, self.plan
        deadline = began + args.timeout
        self._start(
            supervisor,
            plan.trainer,
            _with_threads([*trainer_command(plan), "--nproc", str(self.ranks)], args.threads),
        )
        bootstrap = None
        while bootstrap is None:
            self._check(supervisor, deadline, "the trainer's listening address")
            document = read_node_file(plan.trainer)
            if document is not None:
                bootstrap = next((a for a in document.get("multiaddrs") or [] if "/p2p/" in a), None)
            time.sleep(0.25)
        self.trainer_up_s = time.monotonic() - began
        for node in plan.nodes[1:]:
            self._start(supervisor, node, _with_threads(joiner_command(plan, node, bootstrap), args.threads))
        say(f"ranks {self.ranks}: trainer up after {self.trainer_up_s:.0f} s; inferer and validator started")
        last_line, trained_at = 0.0, None
        while True:
            self._check(supervisor, deadline, f"{args.steps} trained steps")
            self._poll()
            steps = len(_metrics_lines(self.output))
            now = time.monotonic()
            for step in range(1, steps + 1):
                if step not in self.step_seen_at:
                    self.step_seen_at[step] = now
                    self.bytes_at_step[step] = sampler.trainer_bytes()
            if steps >= args.steps and trained_at is None:
                trained_at = now
                sampler.sample()
                self.peak_at_last_step = sampler.peaks_mib()
            if trained_at is not None:
                last = args.steps
                if all(last in self.held_at[n.name] for n in plan.nodes[1:]):
                    return
                if now - trained_at > GRACE_S:
                    self.error = f"the workers did not hold policy {last} within {GRACE_S:.0f} s"
                    return
            if now - last_line > 30:
                last_line = now
                say(f"ranks {self.ranks}: {now - began:4.0f} s, {steps} steps trained")
            time.sleep(POLL_S)

    def _check(self, supervisor: Supervisor, deadline: float, what: str) -> None:
        for child in supervisor.exited():
            raise RunFailedError(
                f"{child.name} exited with {child.process.returncode} (log {child.log_path}):\n"
                + child.log_tail(30)
            )
        if time.monotonic() > deadline:
            raise RunFailedError(f"no {what} within {self.args.timeout:.0f} s")

    def _poll(self) -> None:
        for node in self.plan.nodes:
            snapshot = fetch(node)
            if snapshot is None:
                continue
            self.snapshots[node.name] = snapshot
            now = time.monotonic()
            for version in _versions(snapshot):
                step = int(version.get("step", -1))
                self.kinds[node.name].setdefault(step, set()).add(str(version.get("kind")))
                if version.get("kind") == "full" and version.get("state") in ("complete", "seeding"):
                    self.held_at[node.name].setdefault(step, now)

    # -- figures ------------------------------------------------------------------------------------------

    def _result(self, sampler: Sampler, wall_s: float) -> dict[str, Any]:
        args, ranks = self.args, self.ranks
        params = model_params(self.model_dir)
        policies = sorted(p for p in (self.output / "policies").glob("step_*") if p.is_dir())
        self.full_bytes = _dir_bytes(policies[-1]) if policies else 0  # one full version (all its files)
        share = BYTES_PER_PARAM * params / ranks
        trained = _metrics_lines(self.output)
        peaks = sampler.peaks_mib()
        at_last = self.peak_at_last_step or peaks
        rank_labels = [f"trainer_rank{r}" for r in range(ranks)]
        ratios = [round(at_last[r] * MIB / share, 3) if r in at_last else None for r in rank_labels]
        probe = _probe_lines(self.probe)
        steps0 = [line for line in probe if line.get("rank") == 0 and "step" in line]
        opened = [line for line in probe if "opened_s" in line]
        names = {node.role: node.name for node in self.plan.nodes}
        trainer_s = _section(self.snapshots.get(names["trainer"]), "training")
        inferer_s = _section(self.snapshots.get(names["inferer"]), "rollouts")
        validator_s = _section(self.snapshots.get(names["validator"]), "validation")
        result: dict[str, Any] = {
            "ranks": ranks,
            "policy_steps_trained": len(trained),
            "wall_s": round(wall_s, 1),
            "trainer_up_s": round(self.trainer_up_s, 1) if self.trainer_up_s is not None else None,
            "session_open_s": [round(line["opened_s"], 1) for line in opened],
            "peak_rss_mib": peaks,
            "peak_rss_mib_at_last_step": at_last,
            "share_mib": round(share / MIB, 1),
            "rss_per_rank_ratio": ratios,
        }
        result.update(self._timings(steps0, trainer_s, inferer_s, validator_s))
        result["bytes_written_per_step"] = self._bytes(steps0, trainer_s)
        result["verified"] = self._verified(inferer_s, validator_s)
        result["batches"] = {
            "inferer_published": inferer_s.get("published"),
            "inferer_rejected": inferer_s.get("rejected"),
            "validated": validator_s.get("validated"),
            "validator_accepted": validator_s.get("accepted"),
            "validator_rejected": validator_s.get("rejected"),
            "trainer_accepted": trainer_s.get("batches_accepted"),
            "trainer_trained": trainer_s.get("batches_trained"),
            "trainer_rejected": trainer_s.get("batches_rejected"),
        }
        result["groups_kept"] = [line.get("groups_kept") for line in trained]
        if args.delta_check:
            result["delta_offline"] = offline_delta(self.output / "policies")
        sizes, parts = result["bytes_written_per_step"], result["parts_s"]
        policy_bytes, state_bytes = sizes["policy_file_bytes"], sizes["state_bytes"]
        result["gb_per_s"] = {  # the per-byte (so per-parameter) costs docs/scaling.md extrapolates from
            "policy_file_write": _rate(policy_bytes, _mean(result["checkpoint_s_per_step"]["policy_file"])),
            "state_save_background": _rate(state_bytes, result["state_save_s"]),
            "policy_transfer": _rate(policy_bytes, parts["policy_transfer"]),
            "delta_encode": result["delta_encode_gb_per_s"],
            "delta_apply_offline": (result.get("delta_offline") or {}).get("apply_gb_per_s"),
        }
        if self.error:
            result["error"] = self.error
        return result

    def _timings(
        self,
        steps0: list[dict[str, Any]],
        trainer_s: dict[str, Any],
        inferer_s: dict[str, Any],
        validator_s: dict[str, Any],
    ) -> dict[str, Any]:
        def stage(section: dict[str, Any], name: str, key: str = "stages") -> float | None:
            found = section.get(key, {}).get(name)
            return round(float(found["mean_s"]), 3) if found and found.get("count") else None

        per_step: dict[str, list[float]] = {"session_step": [], "train": [], "policy_file": [], "state": []}
        previous = {"train_s": 0.0, "policy_s": 0.0, "state_s": 0.0}
        for line in steps0:
            times = line["times"]
            per_step["session_step"].append(line["ended"] - line["began"])
            per_step["train"].append(times["train_s"] - previous["train_s"])
            per_step["policy_file"].append(times["policy_s"] - previous["policy_s"])
            per_step["state"].append(times["state_s"] - previous["state_s"])
            previous = times
        n = len(steps0)
        loop_s = (steps0[-1]["ended"] - steps0[0]["ended"]) / (n - 1) if n > 1 else None
        on_path = sum(per_step["policy_file"]) + sum(per_step["state"])
        session_s = sum(per_step["session_step"])
        publishing = trainer_s.get("publishing", {})
        time_s = trainer_s.get("time_s", {})
        trained = max(1, int(trainer_s.get("step", 0) or 0))
        encodes = sum(v for k, v in publishing.get("reasons", {}).items() if k in ("delta", "too_large"))
        full_each = self.full_bytes
        encode_s = publishing.get("encode_s", 0.0)
        announced = _announcements(self.plan.trainer.log_path)
        late = _late_deltas(announced)
        if not encodes and late:  # every delta came after its full version: publishing counted none
            encodes, encode_s = len(late), sum(late)
        transfers = []
        inferer, trainer_name = self.plan.of_role("inferer")[0].name, self.plan.trainer.name
        for step, held in sorted(self.held_at[inferer].items()):
            seeded = self.held_at[trainer_name].get(step)
            if step >= 1 and seeded is not None:
                transfers.append(round(held - seeded, 1))
        generate = stage(inferer_s, "generate")
        validate = stage(validator_s, "validate")
        parts = {
            "generate": generate,
            "prove": stage(inferer_s, "prove"),
            "sign": stage(inferer_s, "sign"),
            "publish_batch": stage(inferer_s, "publish"),
            "rollout_fetch_validator": stage(validator_s, "fetch"),
            "validate": validate,
            "publish_verdict": stage(validator_s, "publish_verdict"),
            "rollout_fetch_trainer": stage(trainer_s, "fetch", "admission_stages"),
            "await_verdict": stage(trainer_s, "await_verdict", "admission_stages"),
            "admit": stage(trainer_s, "admit"),
            "queue": stage(trainer_s, "queue"),
            "train": _mean(per_step["train"]),
            "checkpoint": _mean(
                [a + b for a, b in zip(per_step["policy_file"], per_step["state"], strict=True)]
            ),
            "publish_policy_dir": round(time_s.get("write_s", 0.0) / trained, 3),
            "share": round(time_s.get("share_s", 0.0) / trained, 3),
            "delta_encode": round(encode_s / encodes, 3) if encodes else None,
            "policy_transfer": _mean(transfers),
        }
        return {
            "step_s": round(loop_s, 2) if loop_s is not None else None,
            "parts_s": parts,
            "session_step_s": [round(x, 2) for x in per_step["session_step"]],
            "checkpoint_s_per_step": {
                "policy_file": [round(x, 3) for x in per_step["policy_file"]],
                "state": [round(x, 3) for x in per_step["state"]],
            },
            "checkpoint_share": round(on_path / session_s, 4) if session_s else None,
            "checkpoint_share_of_loop": round(on_path / n / loop_s, 4) if n and loop_s else None,
            "state_saves": sum(1 for line in steps0 if line.get("save")),
            "state_save_s": steps0[-1].get("last_save_s") if steps0 else None,
            "policy_transfer_s": transfers,
            "announced": [{k: v for k, v in a.items() if k != "t"} for a in announced],
            "late_delta_encode_s": late,
            "publishing": publishing,
            "delta_encode_gb_per_s": round(encodes * full_each / encode_s / 1e9, 4) if encode_s else None,
            "validation_over_generation": round(validate / generate, 3) if validate and generate else None,
            "stages_s": {
                "inferer": {k: v["mean_s"] for k, v in inferer_s.get("stages", {}).items()},
                "validator": {k: v["mean_s"] for k, v in validator_s.get("stages", {}).items()},
                "trainer": {k: v["mean_s"] for k, v in trainer_s.get("stages", {}).items()},
                "admission": {k: v["mean_s"] for k, v in trainer_s.get("admission_stages", {}).items()},
            },
            "trainer_time_s": time_s,
        }

    def _bytes(self, steps0: list[dict[str, Any]], trainer_s: dict[str, Any]) -> dict[str, Any]:
        seen = sorted(self.step_seen_at)
        measured = None
        if len(seen) > 1:
            first, last = seen[0], seen[-1]
            measured = (self.bytes_at_step[last] - self.bytes_at_step[first]) / (last - first)
        staged = sorted((self.output / "policies").glob("step_*/model.safetensors"))
        states = sorted((self.output / "train_state").glob("sharded_*"))
        publishing = trainer_s.get("publishing", {})
        full, deltas = publishing.get("full", 0), publishing.get("delta", 0)
        full_each = self.full_bytes
        return {
            "trainer_io_bytes": round(measured) if measured is not None else None,
            "policy_file_bytes": staged[-1].stat().st_size if staged else None,
            "state_bytes": _dir_bytes(states[-1]) if states else None,
            "state_saves_per_step": round(sum(1 for x in steps0 if x.get("save")) / max(1, len(steps0)), 3),
            "delta_bytes": round((publishing.get("wire_bytes", 0) - full * full_each) / deltas)
            if deltas
            else None,
        }

    def _verified(self, inferer_s: dict[str, Any], validator_s: dict[str, Any]) -> dict[str, Any]:
        published = [s for s in sorted(self.held_at[self.plan.trainer.name]) if s <= self.args.steps]
        out: dict[str, Any] = {"published": published}
        everything = bool(published)
        for node in self.plan.nodes[1:]:
            section = _section(self.snapshots.get(node.name), "checkpoints")
            held = sorted(self.held_at[node.name])
            deltas = sorted(s for s, kinds in self.kinds[node.name].items() if "delta" in kinds)
            missing = [s for s in published if s not in held]
            bad = section.get("bad_deltas")
            out[node.role] = {
                "held_complete": held,
                "delta_versions_seen": deltas,
                "rebuilt_from_delta": _rebuilt_steps(node.log_path),
                "reconstructions": section.get("reconstructions"),
                "bad_deltas": bad,
                "missing": missing,
            }
            everything = everything and not missing and bad == 0
        out["all_verified"] = everything and not validator_s.get("rejected") and not inferer_s.get("rejected")
        return out


class RunFailedError(Exception):
    """A child exited or a deadline passed: the run at this world size ends (its figures so far are kept)."""


def _rate(size: int | None, seconds: float | None) -> float | None:
    return round(size / seconds / 1e9, 4) if size and seconds else None


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def offline_delta(policies: Path) -> dict[str, Any] | None:
    """Encode and apply the delta between the last two published policies (the swarm's codec), timed."""
    from prime_node.swarm.delta_codec import apply_delta, encode_delta

    found = sorted(p for p in policies.glob("step_*") if (p / "model.safetensors").is_file())
    if len(found) < 2:
        return None
    base, target = found[-2], found[-1]
    with tempfile.TemporaryDirectory(dir=policies.parent) as tmp:
        delta = Path(tmp) / "delta.bin"
        began = time.perf_counter()
        stats = encode_delta(base, target, delta)
        encode_s = time.perf_counter() - began
        full = _dir_bytes(target)
        began = time.perf_counter()
        apply_delta(base, delta, Path(tmp) / "out", max_output_bytes=full)
        apply_s = time.perf_counter() - began
        identical = _same_bytes(Path(tmp) / "out" / "model.safetensors", target / "model.safetensors")
    return {
        "base": base.name,
        "target": target.name,
        "full_bytes": full,
        "delta_bytes": stats.delta_bytes,
        "changed_share": round(stats.changed_values / max(1, stats.total_values), 5),
        "encode_s": round(encode_s, 2),
        "apply_s": round(apply_s, 2),
        "encode_gb_per_s": round(full / encode_s / 1e9, 4),
        "apply_gb_per_s": round(full / apply_s / 1e9, 4),
        "identical": identical,
    }


def _same_bytes(a: Path, b: Path) -> bool:
    with a.open("rb") as left, b.open("rb") as right:
        while True:
            x, y = left.read(1 << 24), right.read(1 << 24)
            if x != y:
                return False
            if not x:
                return True


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- main -------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="0.6b", choices=["tiny", "0.6b"], help="model to make")
    parser.add_argument("--model-dir", type=Path, help="use this model directory as it is")
    parser.add_argument("--make-model", type=Path, help="only make (and EOS-calibrate) the model here")
    parser.add_argument("--ranks", default="1,2", help="comma-separated trainer world sizes")
    parser.add_argument("--steps", type=int, default=3, help="policy steps to train per world size")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (one prompt per step)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--eos-p", type=float, default=0.1, help="EOS probability per sampled token")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--checkpoint-every", default="auto", help='training state every N steps or "auto"')
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per world size")
    parser.add_argument("--no-delta-check", dest="delta_check", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="where runs live (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--calibrate-eos", type=Path, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.calibrate_eos:
        calibrate_eos(args.calibrate_eos, args.eos_p, args.temperature, args.max_new_tokens, args.seed)
        return
    if args.make_model:
        print(json.dumps(make_model(args.size, args.make_model, args)))
        return
    ranks = [int(r) for r in args.ranks.split(",")]
    began, load_before = time.monotonic(), os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="prime-node-scale-", dir=args.workdir or os.environ.get("BENCH_TMP")))
    results: dict[str, dict[str, Any]] = {}
    try:
        with stop_signals_raise():
            if args.model_dir is not None:
                model_dir = args.model_dir.resolve()
                info_file = _calibration_file(model_dir)
                model = json.loads(info_file.read_text()) if info_file.is_file() else {"given": True}
            else:
                model_dir = root / f"qwen3-{args.size}"
                say(f"making the model in {model_dir}")
                model = make_model(args.size, model_dir, args)
            params = model_params(model_dir)
            for n in ranks:
                world = World(n, args, model_dir, root)
                results[str(n)] = world.run()
                say(f"ranks {n}: {json.dumps(results[str(n)])}")
                if not args.keep:
                    shutil.rmtree(world.workdir, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(summary(args, ranks, params, model, results, began, load_before)))
    short = {
        n: r.get("policy_steps_trained", 0)
        for n, r in results.items()
        if r.get("policy_steps_trained", 0) < MIN_STEPS
    }
    if short:
        raise SystemExit(f"fewer than {MIN_STEPS} policy steps trained at world size(s) {short}")


def summary(
    args: argparse.Namespace,
    ranks: list[int],
    params: int,
    model: dict[str, Any],
    results: dict[str, dict[str, Any]],
    began: float,
    load_before: float,
) -> dict[str, Any]:
    def each(key: str) -> dict[str, Any]:
        return {n: r.get(key) for n, r in results.items()}

    ratios = [x for r in results.values() for x in r.get("rss_per_rank_ratio", []) if x is not None]
    shares = [r["checkpoint_share"] for r in results.values() if r.get("checkpoint_share") is not None]
    rates = [
        rate
        for r in results.values()
        for rate in (r.get("delta_encode_gb_per_s"), (r.get("delta_offline") or {}).get("apply_gb_per_s"))
        if rate
    ]
    ratio_vg = [
        r["validation_over_generation"] for r in results.values() if r.get("validation_over_generation")
    ]
    return {
        "benchmark": "scale",
        "model": f"{model['arch']}-{model['size']}, vocab {model.get('vocab_size')}"
        if "arch" in model
        else str(args.model_dir),
        "model_dir_given": args.model_dir is not None,
        "params": params,
        "eos_calibration": model.get("eos_calibration"),
        "policy_steps_trained": min((r.get("policy_steps_trained", 0) for r in results.values()), default=0),
        "policy_steps_trained_by_ranks": each("policy_steps_trained"),
        "rss_per_rank_ratio": max(ratios) if ratios else None,
        "rss_goal": RSS_GOAL,
        "rss_per_rank_ratio_by_ranks": each("rss_per_rank_ratio"),
        "peak_rss_mib_by_ranks": each("peak_rss_mib_at_last_step"),
        "peak_rss_mib_whole_run_by_ranks": each("peak_rss_mib"),
        "checkpoint_share": max(shares) if shares else None,
        "checkpoint_share_by_ranks": each("checkpoint_share"),
        "checkpoint_share_of_loop_by_ranks": each("checkpoint_share_of_loop"),
        "delta_gb_per_s": min(rates) if rates else None,
        "delta_encode_gb_per_s_by_ranks": each("delta_encode_gb_per_s"),
        "delta_offline_by_ranks": each("delta_offline"),
        "step_s_by_ranks": each("step_s"),
        "parts_s_by_ranks": each("parts_s"),
        "bytes_written_per_step_by_ranks": each("bytes_written_per_step"),
        "gb_per_s_by_ranks": each("gb_per_s"),
        "validation_over_generation": max(ratio_vg) if ratio_vg else None,
        "verified_by_ranks": each("verified"),
        "details_by_ranks": {
            n: {k: v for k, v in r.items() if k not in HEADLINE} for n, r in results.items()
        },
        "settings": {
            "ranks": ranks,
            "steps": args.steps,
            "group_size": args.group,
            "prompts_per_step": 1,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "learning_rate": args.lr,
            "async_level": 1,
            "threads_per_process": args.threads,
            "checkpoint_every": args.checkpoint_every,
            "activation_checkpointing": args.activation_checkpointing,
            "inference_dtype": "float32",
            "validator_dtype": "float32",
            "publish_dtype": "bfloat16",
            "train_dtype": "float32 (auto on CPU)",
            "vocab_note": "Qwen3-0.6B's shape with a 4,096-token vocabulary (151,936 in the real model), "
            "so the embedding does not dominate on a CPU"
            if model.get("size") == "0.6b" and model.get("vocab_size") == 4096
            else None,
        },
        "cores": os.cpu_count(),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - began, 1),
    }


if __name__ == "__main__":
    main()
