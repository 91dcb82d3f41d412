"""The wheel installs exactly our three top-level packages, needs no dev-only dependency, and an installed
wheel's `crypto` and `protocol` are ours (not another distribution's, not the source tree's)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.test_layering import _dev_only_imports, _imported_modules, _imports_of

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a clean copy of the tree: an in-tree build reuses build/lib, which keeps modules that
    # have since been deleted or moved, so the wheel would ship them.
    source = tmp_path_factory.mktemp("source") / "prime-node"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("prime_node-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_only_our_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"crypto", "protocol", "prime_node"}
    assert "prime_node/py.typed" in names
    assert "prime_node/assets/tiny_arithmetic/model.safetensors" in names  # package data: the demo model
    assert "prime_node/assets/tokenizer_corpus/code.txt" in names  # the BPE tokenizer's training text
    assert not any(name.startswith(("tests/", "benchmarks/", "examples/")) for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "prime-node = prime_node.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_the_wheel_imports_no_dev_dependency(wheel: Path, tmp_path: Path) -> None:
    """The wheel installs without the ``dev`` extra: none of its modules imports hypothesis or another
    dev-only package (the test kit it ships, prime_node/testing, included)."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path)
    sources = sorted(tmp_path.rglob("*.py"))
    assert tmp_path / "prime_node" / "testing" / "memory_network.py" in sources
    dev_only = _dev_only_imports()
    violations = {
        str(path.relative_to(tmp_path)): _imports_of(_imported_modules(path, root=tmp_path), dev_only)
        for path in sources
    }
    assert {k: v for k, v in violations.items() if v} == {}


@pytest.mark.slow
def test_installed_wheel_imports_our_crypto_and_protocol(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    target = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    # Dependencies come from the test environment, appended *after* the venv's own site-packages, so a
    # same-named package elsewhere could only shadow ours if the install were wrong.
    (target / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = (
        "import crypto, protocol, prime_node, crypto.keys, protocol.envelope;"
        "print(crypto.__file__); print(protocol.__file__); print(prime_node.__file__);"
        "from crypto.keys import WalletKey; from protocol.envelope import Domain, seal;"
        "print(seal(WalletKey.generate(), Domain('t', 'r'), b'x', now_ms=1).signer)"
    )
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True
    )
    crypto_file, protocol_file, prime_node_file, signer = result.stdout.split()
    for path in (crypto_file, protocol_file, prime_node_file):
        assert Path(path).is_relative_to(target), path
    assert signer.startswith("0x")
