"""The ``prime-node`` command. Every command group lives in its own module under prime_node/cli/ and is
listed in COMMAND_MODULES; heavy libraries (torch, transformers, libp2p) are imported inside command
bodies only, so ``prime-node --help`` stays instant.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Annotated

import typer

from prime_node import __version__
from prime_node.errors import NodeError
from prime_node.warm_start.child import run_as_process

# Each module defines ``register(app: typer.Typer) -> None``. Add one line per command module.
COMMAND_MODULES = (
    "prime_node.cli.wallet",
    "prime_node.cli.init_model",
    "prime_node.cli.run_trainer",
    "prime_node.cli.node",
    "prime_node.cli.validate",
    "prime_node.cli.swarm",
    "prime_node.cli.demo",
    "prime_node.cli.doctor",
    "prime_node.cli.new_run",
)

log = logging.getLogger("prime_node")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"prime-node {__version__}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="prime-node",
        help="Join a decentralized reinforcement-learning run: train, infer or validate.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
        rich_markup_mode=None,
    )

    @app.callback()
    def root(
        version: Annotated[
            bool,
            typer.Option(
                "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
            ),
        ] = False,
        log_level: Annotated[
            str,
            typer.Option("--log-level", envvar="PRIME_NODE_LOG_LEVEL", help="debug, info, warning or error."),
        ] = "warning",
    ) -> None:
        logging.basicConfig(
            level=getattr(logging, log_level.upper(), logging.WARNING),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )

    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(app)
    return app


def main() -> None:
    """Console-script entry point (and ``python -m prime_node``): ``run_command``, then leave without
    CPython's interpreter finalisation, as a warm-started process does (``warm_start.child.run_as_process``:
    non-daemon threads joined, atexit run, streams flushed, the exit status kept). Tearing torch's and
    transformers' modules down one by one costs ~2.5 CPU-s per process: on a loaded machine the demo's
    nodes, stopped cleanly, were still in it when the supervisor SIGKILLed them 8 s after SIGTERM (issue
    36), and the node's shutdown watchdog cannot fire then."""
    run_as_process(run_command)


def run_command() -> None:
    """The command: our own errors become one line on stderr and exit status 1 (as SystemExit, so a test
    can run it in its own process: tests/cli_in_process.py)."""
    from crypto.errors import CryptoError
    from protocol.errors import ProtocolError

    try:
        build_app()(prog_name="prime-node")
    except (NodeError, CryptoError, ProtocolError) as exc:
        log.debug("command failed", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except OSError as exc:
        log.debug("command failed", exc_info=True)
        where = f": {exc.filename}" if exc.filename else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130 if os.name == "posix" else 1)


if __name__ == "__main__":
    main()
