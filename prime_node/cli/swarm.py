"""``prime-node share DIR`` (sign, announce and seed a checkpoint) and ``prime-node fetch MANIFEST_ID``
(download one from the swarm, verify it, write it atomically). Both run a full node for their duration."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prime_node.cli.network_options import DEFAULT_FLAGS, NodeFlags, RunOption, with_node_flags
from prime_node.cli.options import JsonOption
from prime_node.errors import NodeError

if TYPE_CHECKING:
    from crypto.keys import WalletKey
    from prime_node.node.service import Node
    from prime_node.node_config import NodeConfig
    from prime_node.swarm.service import SwarmService

STORE_SUBDIR = "swarm"
DataplaneHostOption = Annotated[
    str, typer.Option("--dataplane-host", help="Address the data plane listens on.")
]


def register(app: typer.Typer) -> None:
    app.command("share")(share)
    app.command("fetch")(fetch)


@with_node_flags()
def share(
    directory: Annotated[Path, typer.Argument(help="Hugging Face model directory to share.")],
    step: Annotated[int, typer.Option("--step", min=0, help="Training step of this checkpoint.")] = 0,
    piece_size: Annotated[
        int | None, typer.Option("--piece-size", help="Piece size in bytes (power of two; default 4 MiB).")
    ] = None,
    as_json: JsonOption = False,
    node: NodeFlags = DEFAULT_FLAGS,
    run: RunOption = "demo",
    dataplane_host: DataplaneHostOption = "0.0.0.0",
) -> None:
    """Sign DIR as the run's checkpoint for --step with this node's key (the trainer's), announce it and
    seed it until SIGINT/SIGTERM. Prints the manifest id (with --json one JSON line)."""
    from prime_node.swarm.service import SwarmService

    config = node.config(run)
    key = node.key()
    swarm = SwarmService(
        key=key,
        run_id=config.run_id,
        trainer=key.address,
        store_dir=config.data_dir / STORE_SUBDIR,
        dataplane_host=dataplane_host,
        dataplane_port=node.dataplane_port,
        follow=False,
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
        str | None, typer.Option("--trainer", help="Accept only a manifest signed by this address.")
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
    as_json: JsonOption = False,
    node: NodeFlags = DEFAULT_FLAGS,
    run: RunOption = "demo",
    dataplane_host: DataplaneHostOption = "0.0.0.0",
) -> None:
    """Download checkpoint MANIFEST_ID from the swarm, verify every piece, write it to --out atomically.
    A rerun after an interruption resumes from the pieces already verified in --data-dir."""
    from crypto.keys import Address
    from prime_node.swarm.service import SwarmService

    try:
        mid = bytes.fromhex(manifest_id)
        if len(mid) != 32:
            raise ValueError
    except ValueError:
        raise NodeError(
            f"not a manifest id (want 64 hex digits): {manifest_id[:80]}", reason="bad_id"
        ) from None
    trainer_address = Address.parse(trainer) if trainer else None
    if run_config is not None:
        from prime_node.config.run import load_run_config

        loaded = load_run_config(run_config)
        run = loaded.run_id
        if trainer_address is None and loaded.trainer_address:
            trainer_address = Address.parse(loaded.trainer_address)
    out = out.absolute()
    if out.exists():
        raise NodeError(f"{out} already exists; choose another --out or remove it", reason="output_exists")
    _probe_writable(out.parent)
    config = node.config(run)
    key = node.key()
    swarm = SwarmService(
        key=key,
        run_id=config.run_id,
        trainer=trainer_address,
        store_dir=config.data_dir / STORE_SUBDIR,
        dataplane_host=dataplane_host,
        dataplane_port=node.dataplane_port,
        follow=False,
        upload=not no_upload,
    )

    async def body(running: Node) -> None:
        import trio

        started = trio.current_time()
        found = None
        with trio.move_on_after(timeout):
            found = await swarm.get_manifest(mid)
        if found is None:
            raise NodeError(
                f"no peer offered manifest {manifest_id} within {timeout:g} s", reason="manifest_not_found"
            )
        manifest = found[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_show_progress, swarm, mid, manifest.piece_count, manifest.piece_size)
            path = await swarm.fetch(mid, out=out)
            nursery.cancel_scope.cancel()
        seconds = trio.current_time() - started
        if as_json:
            document = {
                "manifest_id": manifest_id.lower(),
                "step": manifest.step,
                "bytes": manifest.total_size,
                "pieces": manifest.piece_count,
                "resumed_pieces": swarm.resumed_pieces(mid),
                "seconds": round(seconds, 3),
                "out": str(path),
            }
            typer.echo(json.dumps(document))
        else:
            typer.echo(f"wrote {path} (step {manifest.step}, {manifest.total_size} bytes, {seconds:.1f} s)")

    _run(config, key, swarm, body, until_signal=False)


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
