"""``prime-node share DIR`` (sign, announce and seed a checkpoint) and ``prime-node fetch MANIFEST_ID``
(download one from the swarm, verify it, write it atomically). Both run a full node for their duration."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prime_node.cli.manifest_wait import ManifestWait
from prime_node.cli.network_options import DEFAULT_FLAGS, NodeFlags, join_target, with_node_flags
from prime_node.cli.options import JsonOption
from prime_node.cli.seeding import SEED_IDLE, SWARM_SEED_LIMIT, parse_seed_until, seed_version
from prime_node.errors import NodeError
from prime_node.paths import PASSWORD_FILE_ENV

if TYPE_CHECKING:
    from crypto.keys import Address, WalletKey
    from prime_node.node.service import Node
    from prime_node.node_config import NodeConfig
    from prime_node.swarm.service import SwarmService

log = logging.getLogger(__name__)

STORE_SUBDIR = "swarm"
DataplaneHostOption = Annotated[
    str, typer.Option("--dataplane-host", help="Address the data plane listens on.")
]
SwarmRunOption = Annotated[
    str,
    typer.Option(
        "--run",
        help="The run, as its run address RUN@0xTRAINER[,BOOTSTRAP...] (as join --run and doctor --run: "
        "pins the trainer and adds the bootstrap peers) or a bare run id.",
    ),
]


def register(app: typer.Typer) -> None:
    app.command("share")(share)
    app.command("fetch")(fetch)


@with_node_flags()
def share(
    directory: Annotated[Path, typer.Argument(help="Hugging Face model directory to share.")],
    step: Annotated[int, typer.Option("--step", min=0, help="Training step of this checkpoint.")] = 0,
    piece_size: Annotated[
        int | None,
        typer.Option(
            "--piece-size",
            help="Piece size in bytes (a power of two). Default: it follows the checkpoint: 4 MiB, halved "
            "down to 256 KiB while that gives fewer than 240 pieces (so a checkpoint under ~60 MB gets "
            "256 KiB pieces), doubled past 131,072 pieces.",
        ),
    ] = None,
    as_json: JsonOption = False,
    node: NodeFlags = DEFAULT_FLAGS,
    run: SwarmRunOption = "demo",
    dataplane_host: DataplaneHostOption = "0.0.0.0",
) -> None:
    """Sign DIR as the run's checkpoint for --step with this node's key (the trainer's), announce it and
    seed it until SIGINT/SIGTERM. Prints the manifest id (with --json one JSON line)."""
    from prime_node.swarm.service import SwarmService, SwarmSettings

    target = join_target(run, None)
    node = _with_bootstrap(node, target.bootstrap)
    config = node.config(target.run_id)
    key = node.key()
    if target.trainer is not None and target.trainer != key.address:
        raise NodeError(
            f"--run names trainer {target.trainer}, but this node's key is {key.address}: only the run's "
            "trainer may share its checkpoints",
            reason="not_trainer",
        )
    swarm = SwarmService(
        key=key,
        run_id=config.run_id,
        trainer=key.address,
        store_dir=config.data_dir / STORE_SUBDIR,
        settings=SwarmSettings(
            dataplane_host=dataplane_host, dataplane_port=node.dataplane_port, follow=False
        ),
    )

    async def body(running: Node) -> None:
        manifest = await swarm.share(directory, step=step, piece_size=piece_size)
        if as_json:
            document = {
                "manifest_id": manifest.id().hex(),
                "step": manifest.step,
                "run": manifest.run,
                "pieces": manifest.piece_count,
                "bytes": manifest.total_size,
                "trainer": str(key.address),
                "multiaddrs": running.advertised_multiaddrs(),
            }
            typer.echo(json.dumps(document))
        else:
            typer.echo(manifest.id().hex())
            typer.echo(
                f"seeding step {manifest.step}: {manifest.piece_count} pieces, {manifest.total_size} bytes; "
                f"bootstrap: {running.advertised_multiaddrs()[0]}",
                err=True,
            )

    _run(config, key, swarm, body, until_signal=True)


@with_node_flags(listen="/ip4/0.0.0.0/tcp/0")
def fetch(
    manifest_id: Annotated[str, typer.Argument(help="Manifest id (64 hex digits) printed by `share`.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write (must not exist yet).")],
    trainer: Annotated[
        str | None,
        typer.Option(
            "--trainer", help="Accept only a manifest signed by this address (the same pin as --run RUN@0x…)."
        ),
    ] = None,
    run_config: Annotated[
        Path | None,
        typer.Option("--config", help="Run config (TOML): its trainer_address and run_id.", dir_okay=False),
    ] = None,
    no_upload: Annotated[
        bool, typer.Option("--no-upload", help="Never serve pieces to others while fetching.")
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Give up if no peer offers the manifest within this many s.")
    ] = 60.0,
    seed_until: Annotated[
        str,
        typer.Option(
            "--seed-until",
            help="After writing --out, keep serving until: 'swarm' (every connected peer that wanted the "
            f"checkpoint holds it or has stopped asking us for {SEED_IDLE:g} s; at most "
            f"{SWARM_SEED_LIMIT:g} s, 'swarm:SECONDS' to change that), "
            "'done' (exit at once), 'never' (until Ctrl-C) or a duration ('90', '90s', '5m').",
        ),
    ] = "swarm",
    ephemeral_key: Annotated[
        bool | None,
        typer.Option(
            "--ephemeral-key/--wallet-key",
            help="Fetch under a throwaway identity (no keystore to unlock: fetching signs nothing; peers "
            "see a new address each run), or under the node's wallet. Default: the wallet when a keystore "
            "flag (--keystore, --password-file, --password-env, --no-password, --new-wallet) is given, "
            "else a throwaway identity.",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOption = False,
    node: NodeFlags = DEFAULT_FLAGS,
    run: SwarmRunOption = "demo",
    dataplane_host: DataplaneHostOption = "0.0.0.0",
) -> None:
    """Download checkpoint MANIFEST_ID from the swarm, verify every piece, write it to --out atomically,
    then keep serving it (--seed-until). A rerun after an interruption resumes from the pieces already
    verified in --data-dir. With --json the line printed when --out is written carries `phases`: seconds
    from process start to each step (CLI parsed, imports, key unlocked, node up, manifest, first piece,
    written)."""
    phases = {"cli": _process_age()}
    policy = parse_seed_until(seed_until)
    mid, trainer_address, run, bootstrap = _fetch_target(manifest_id, trainer, run_config, run)
    node = _with_bootstrap(node, bootstrap)
    out = out.absolute()
    if out.exists():
        raise NodeError(f"{out} already exists; choose another --out or remove it", reason="output_exists")
    _probe_writable(out.parent)
    config = node.config(run)
    with _KeyInBackground(node, ephemeral=ephemeral_key) as unlocking:
        # The keystore's scrypt (~1 CPU-s) releases the GIL: these imports (~0.4 s) run beside it.
        from prime_node.node.runner import run_node_until_signal  # noqa: F401  (libp2p, trio: timed)
        from prime_node.swarm.service import SwarmService, SwarmSettings

        phases["imports"] = _process_age()
        key = unlocking.key()
    phases["key"] = _process_age()
    swarm = SwarmService(
        key=key,
        run_id=config.run_id,
        trainer=trainer_address,
        store_dir=config.data_dir / STORE_SUBDIR,
        settings=SwarmSettings(
            dataplane_host=dataplane_host,
            dataplane_port=node.dataplane_port,
            follow=False,
            upload=not no_upload,
        ),
    )

    async def body(running: Node) -> None:
        import trio

        from protocol.codec import decode
        from protocol.manifest import Manifest

        phases["node_up"] = _process_age()
        started = trio.current_time()
        found = await ManifestWait(swarm, running, mid, config.run_id).get(timeout)
        phases["manifest"] = _process_age()
        manifest = found[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_show_progress, swarm, mid, manifest.piece_count, manifest.piece_size)
            nursery.start_soon(_note_first_piece, swarm, mid, phases)
            path = await swarm.fetch(mid, out=out)
            nursery.cancel_scope.cancel()
        phases["written"] = _process_age()
        seconds = trio.current_time() - started
        written = manifest
        if manifest.is_delta:  # --out holds the full checkpoint the delta rebuilt: report that one
            known = swarm.known.get(manifest.target)
            if known is not None:
                written = decode(known.payload, Manifest)
        if as_json:
            document = {
                "manifest_id": manifest_id.lower(),
                "step": written.step,
                "bytes": written.total_size,
                "pieces": written.piece_count,
                "resumed_pieces": swarm.resumed_pieces(mid),
                "seconds": round(seconds, 3),
                "out": str(path),
                "phases": {name: round(at, 3) for name, at in phases.items()},
            }
            if manifest.is_delta:
                document |= {"delta_of": manifest.base.hex(), "full_manifest_id": manifest.target.hex()}
            typer.echo(json.dumps(document))
        else:
            typer.echo(f"wrote {path} (step {written.step}, {written.total_size} bytes, {seconds:.1f} s)")
        await seed_version(swarm, mid, manifest.signer, policy)

    _run(config, key, swarm, body, until_signal=policy.mode == "never")


def _keystore_flags_given(node: NodeFlags) -> bool:
    """Whether the command line names a keystore or how to unlock one: then ``fetch`` runs under the
    wallet (a fetch signs nothing, so without such a flag it needs no wallet, and no password prompt)."""
    return bool(
        node.keystore or node.password_file or node.password_env or node.no_password or node.new_wallet
    )


class _KeyInBackground:
    """The node's key, unlocked in a worker thread while the caller imports (when no password prompt can
    appear: a prompt must own the terminal); ``ephemeral``: a fresh key, nothing to unlock (None: so unless
    a keystore flag was given)."""

    def __init__(self, node: NodeFlags, *, ephemeral: bool | None) -> None:
        self.node = node
        self.ephemeral = not _keystore_flags_given(node) if ephemeral is None else ephemeral
        self.pool: ThreadPoolExecutor | None = None
        self.future: Future[WalletKey] | None = None

    def __enter__(self) -> _KeyInBackground:
        node = self.node
        given = (
            node.password_env or node.password_file or node.no_password or os.environ.get(PASSWORD_FILE_ENV)
        )
        if not self.ephemeral and (given or not sys.stdin.isatty()):
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="keystore")
            self.future = self.pool.submit(node.key)
        return self

    def key(self) -> WalletKey:
        if self.ephemeral:
            from crypto.keys import WalletKey

            return WalletKey.generate()
        return self.future.result() if self.future is not None else self.node.key()

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _fetch_target(
    manifest_id: str, trainer: str | None, run_config: Path | None, run: str
) -> tuple[bytes, Address | None, str, tuple[str, ...]]:
    """The manifest id, the trainer to insist on, the run id and the run address's bootstrap peers, from
    fetch's arguments (``--run`` as ``join_target`` reads it: a run address or a bare run id)."""
    from crypto.keys import Address

    try:
        mid = bytes.fromhex(manifest_id)
        if len(mid) != 32:
            raise ValueError
    except ValueError:
        raise NodeError(
            f"not a manifest id (want 64 hex digits): {manifest_id[:80]}", reason="bad_id"
        ) from None
    target = join_target(run, trainer)
    trainer_address, run = target.trainer, target.run_id
    if run_config is not None:
        from prime_node.config.run import load_run_config

        loaded = load_run_config(run_config)
        run = loaded.run_id
        if trainer_address is None and loaded.trainer_address:
            trainer_address = Address.parse(loaded.trainer_address)
    return mid, trainer_address, run, target.bootstrap


def _with_bootstrap(node: NodeFlags, bootstrap: tuple[str, ...]) -> NodeFlags:
    """``node`` with a run address's bootstrap peers added to ``--bootstrap``."""
    if not bootstrap:
        return node
    return dataclasses.replace(node, bootstrap=[*(node.bootstrap or ()), *bootstrap])


async def _note_first_piece(swarm: SwarmService, mid: bytes, phases: dict[str, float]) -> None:
    """Record when the first piece of this fetch was verified (``phases["first_piece"]``)."""
    import trio

    start = swarm.resumed_pieces(mid)
    while True:
        held = swarm.progress(mid)
        if held is not None and held[0] > start:
            phases["first_piece"] = _process_age()
            return
        await trio.sleep(0.05)


def _process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere since this module was loaded)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _LOADED


_LOADED = time.monotonic()


# --- shared plumbing ---------------------------------------------------------------------------------


def _probe_writable(parent: Path) -> None:
    """Fail before downloading if --out's directory cannot take a file (permission, read-only, full)."""
    from prime_node.atomic_files import node_error_from_os

    for ancestor in (parent, *parent.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise NodeError(
                    f"cannot write --out: {ancestor} is not a directory", reason="not_a_directory"
                )
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".prime-node-probe-", dir=parent)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        error = node_error_from_os(exc, f"preparing --out in {parent}")
        if error.reason == "io_error":
            error = NodeError(f"cannot write --out in {parent}: {exc.strerror or exc}", reason="io_error")
        raise error from exc


async def _show_progress(swarm: SwarmService, mid: bytes, pieces: int, piece_size: int) -> None:
    """A progress bar on stderr: pieces, rate, peers."""
    import trio
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("fetching"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("pieces {task.fields[rate]} {task.fields[peers]} peers"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("fetch", total=pieces, rate="", peers=0)
        last_bytes, last_time = swarm.dataplane.bytes_in, trio.current_time()
        while True:
            await trio.sleep(0.5)
            held = swarm.progress(mid)
            now, received = trio.current_time(), swarm.dataplane.bytes_in
            rate = (received - last_bytes) / max(now - last_time, 1e-6) / 1e6
            last_bytes, last_time = received, now
            bar.update(
                task,
                completed=held[0] if held else 0,
                rate=f"{rate:7.1f} MB/s",
                peers=len(swarm.dataplane.links),
            )


def _run(
    config: NodeConfig,
    key: WalletKey,
    swarm: SwarmService,
    body: Callable[[Node], Awaitable[None]],
    *,
    until_signal: bool,
) -> None:
    """Run a node with the swarm service, then ``body``; stop when it returns (``until_signal``: on
    SIGINT/SIGTERM). Stdout is kept for the command's own output."""
    from prime_node.node.runner import run_node_until_signal

    run_node_until_signal(
        config,
        key,
        echo=lambda line: typer.echo(line, err=True),
        services=[swarm],
        body=body,
        stop_when_body_returns=not until_signal,
        print_identity=False,
    )
