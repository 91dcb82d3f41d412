"""``prime-node fetch`` as the issue 36 user met it (friction 7), as real processes on 127.0.0.1: ``--run``
takes the run address ``join --run`` and ``doctor --run`` take; a wrong trainer is named at once with the
line docs/weight-swarm.md promises, not after the manifest timeout; a wait for a manifest nobody has says
what it is doing; and ``share --help`` says the piece size ``share`` uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from crypto.keys import WalletKey
from prime_node.swarm.checkpoint_pieces import choose_piece_size
from prime_node.testing.swarm_fixtures import read_tree
from tests.cli_in_process import run_cli
from tests.swarm.test_network_cli import NET, WALLET, cli, run, seeder  # noqa: F401  (seeder: a fixture)


def _fetch(tmp: Path, name: str, mid: str, run_address: str, *extra: str) -> list[str]:
    return cli(
        "fetch", mid, "--out", str(tmp / name), "--run", run_address,
        "--data-dir", str(tmp / f"d-{name}"), *NET, *WALLET, "--json", "--seed-until", "done", *extra,
    )  # fmt: skip


@pytest.mark.slow
def test_fetch_takes_the_run_address_and_names_a_wrong_trainer_at_once(
    tmp_path: Path,
    seeder: tuple[dict[str, object], Path],  # noqa: F811
) -> None:
    share, model = seeder
    mid, signer = str(share["manifest_id"]), str(share["trainer"])
    boot = str(share["multiaddrs"][0])  # type: ignore[index]

    # The run address alone: its trainer is pinned, its bootstrap dialled (no --bootstrap, no --trainer).
    done = run(_fetch(tmp_path, "out", mid, f"demo@{signer},{boot}"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert read_tree(tmp_path / "out") == read_tree(model)

    # A run address naming another trainer: refused as soon as the manifest arrives, with the documented
    # line, and never by the manifest timeout (set far above the refusal's time here).
    wrong = str(WalletKey.generate().address)
    refused = run(_fetch(tmp_path, "other", mid, f"demo@{wrong},{boot}", "--timeout", "120"), timeout=300)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: refusing checkpoint {mid}: manifest signed by {signer}, but the run's trainer is {wrong}"
    )
    assert "no peer offered" not in refused.stderr and "gave up on manifest" not in refused.stderr
    assert not (tmp_path / "other").exists()

    # --run and --trainer naming two trainers is a usage error, before any network.
    both = run(_fetch(tmp_path, "both", mid, f"demo@{signer},{boot}", "--trainer", wrong), timeout=60)
    assert both.returncode == 1 and "pass one of them" in both.stderr.strip().splitlines()[-1]

    # An id nobody has: progress lines while waiting, and a last word of what was tried.
    missing = run(_fetch(tmp_path, "none", "ab" * 32, f"demo@{signer},{boot}", "--timeout", "8"), timeout=120)
    assert missing.returncode == 1
    lines = missing.stderr.strip().splitlines()
    assert lines[-1] == f"error: no peer offered manifest {'ab' * 32} within 8 s"
    progress = re.compile(
        r"^waiting for manifest abababababababab… after \d+ s: asked \d+ peer\(s\) of run 'demo'"
    )
    assert any(progress.match(line) for line in lines), missing.stderr
    assert lines[-2].startswith("gave up on manifest abababababababab… after ")


def test_share_help_says_the_piece_size_share_uses(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's 63 MB checkpoint became 242 pieces of 256 KiB while --help said 4 MiB: the size follows
    the checkpoint (docs/weight-swarm.md, choose_piece_size), and the help says so."""
    assert choose_piece_size(63_000_000) == 256 << 10
    assert choose_piece_size(2_000_000_000) == 4 << 20
    shown = run_cli(capsys, "share", "--help")
    text = " ".join(shown.stdout.replace("│", " ").split())
    assert "default 4 MiB" not in text
    assert "256 KiB" in text and "fewer than 240 pieces" in text, text
