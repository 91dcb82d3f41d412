"""`prime-node wallet` as a user runs it: real processes, real files, an independent Ethereum library."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from eth_account import Account
from eth_account.messages import encode_defunct

from tests import warm_cli

PRIME_NODE = [sys.executable, "-m", "prime_node"]


def run(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")}
    full_env.update(env or {})
    return warm_cli.run(
        [*PRIME_NODE, *args],
        check=False,
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def assert_clean_failure(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fragment in result.stderr


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "password.txt"
    path.write_text("hunter2\n")
    return path


@pytest.fixture
def keystore(tmp_path: Path, password_file: Path) -> Path:
    path = tmp_path / "wallet" / "keystore.json"
    result = run(
        "wallet", "new", "--keystore", str(path), "--password-file", str(password_file), "--light-kdf"
    )
    assert result.returncode == 0, result.stderr
    return path


def test_new_writes_a_private_keystore_that_eth_account_opens(keystore: Path) -> None:
    assert stat.S_IMODE(keystore.stat().st_mode) == 0o600
    document = json.loads(keystore.read_text())
    secret = Account.decrypt(document, "hunter2")
    assert Account.from_key(secret).address.lower()[2:] == document["address"]
    assert not [p for p in keystore.parent.iterdir() if p.name.endswith(".tmp")]


def test_new_refuses_to_overwrite(keystore: Path, password_file: Path) -> None:
    before = keystore.read_bytes()
    result = run(
        "wallet", "new", "--keystore", str(keystore), "--password-file", str(password_file), "--light-kdf"
    )
    assert_clean_failure(result, "refusing to overwrite")
    assert keystore.read_bytes() == before


def test_show_json_and_text(keystore: Path, password_file: Path) -> None:
    result = run(
        "wallet", "show", "--keystore", str(keystore), "--password-file", str(password_file), "--json"
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    secret = Account.decrypt(json.loads(keystore.read_text()), "hunter2")
    assert shown["address"] == Account.from_key(secret).address
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.peer.id import ID

    assert shown["peer_id"] == ID.from_pubkey(create_new_key_pair(bytes(secret)).public_key).to_base58()
    text = run("wallet", "show", "--keystore", str(keystore), "--password-file", str(password_file))
    assert shown["address"] in text.stdout and shown["peer_id"] in text.stdout


def test_sign_verifies_in_eth_account_and_verify_accepts_eth_signatures(
    keystore: Path, password_file: Path
) -> None:
    secret = Account.decrypt(json.loads(keystore.read_text()), "hunter2")
    address = Account.from_key(secret).address
    signed = run(
        "wallet", "sign", "hello swarm", "--keystore", str(keystore), "--password-file", str(password_file)
    )
    assert signed.returncode == 0, signed.stderr
    signature = signed.stdout.strip()
    assert signature.startswith("0x") and len(signature) == 2 + 130
    assert Account.recover_message(encode_defunct(text="hello swarm"), signature=signature) == address

    theirs = "0x" + bytes(Account.sign_message(encode_defunct(text="from geth"), secret).signature).hex()
    ok = run("wallet", "verify", "from geth", theirs, address)
    assert (ok.returncode, ok.stdout.strip()) == (0, f"valid: signed by {address}")
    wrong_message = run("wallet", "verify", "from geth!", theirs, address)
    assert wrong_message.returncode == 1 and wrong_message.stderr.startswith("invalid:")
    as_hex = run("wallet", "verify", "0x" + b"from geth".hex(), theirs, address, "--hex")
    assert as_hex.returncode == 0


@pytest.mark.parametrize(
    ("signature", "address", "fragment"),
    [
        ("0xzz", "0x" + "11" * 20, "not valid hex"),
        ("0x" + "11" * 64, "0x" + "11" * 20, "must be 65 bytes"),
        ("0x" + "11" * 65, "0x1234", "not an address"),
    ],
)
def test_verify_malformed_input(signature: str, address: str, fragment: str) -> None:
    assert_clean_failure(run("wallet", "verify", "m", signature, address), fragment)


def test_wrong_password_corrupt_and_truncated_keystores(keystore: Path, tmp_path: Path) -> None:
    before = keystore.read_bytes()
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("not it\n")
    assert_clean_failure(
        run("wallet", "show", "--keystore", str(keystore), "--password-file", str(wrong)), "wrong password"
    )
    truncated = tmp_path / "truncated.json"
    truncated.write_bytes(before[: len(before) // 2])
    assert_clean_failure(
        run("wallet", "show", "--keystore", str(truncated), "--no-password"), "not valid JSON"
    )
    corrupt = tmp_path / "corrupt.json"
    document = json.loads(before)
    document["crypto"]["ciphertext"] = "zz"
    corrupt.write_text(json.dumps(document))
    assert_clean_failure(
        run("wallet", "sign", "m", "--keystore", str(corrupt), "--no-password"), "not valid hex"
    )
    assert_clean_failure(
        run("wallet", "show", "--keystore", str(tmp_path / "missing.json"), "--no-password"), "no keystore"
    )
    assert keystore.read_bytes() == before


def test_environment_variables_choose_keystore_and_password(tmp_path: Path, password_file: Path) -> None:
    env = {
        "PRIME_NODE_KEYSTORE": str(tmp_path / "env-wallet.json"),
        "PRIME_NODE_PASSWORD_FILE": str(password_file),
    }
    created = run("wallet", "new", "--light-kdf", "--json", env=env)
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["keystore"] == env["PRIME_NODE_KEYSTORE"]
    shown = run("wallet", "show", "--json", env=env)
    assert json.loads(shown.stdout)["address"] == json.loads(created.stdout)["address"]
    by_env_var = run(
        "wallet",
        "show",
        "--json",
        "--password-env",
        "MY_PW",
        env={"PRIME_NODE_KEYSTORE": env["PRIME_NODE_KEYSTORE"], "MY_PW": "hunter2"},
    )
    assert by_env_var.returncode == 0, by_env_var.stderr


def test_default_keystore_lives_in_the_data_dir(tmp_path: Path) -> None:
    created = run(
        "wallet", "new", "--no-password", "--light-kdf", "--json", env={"PRIME_NODE_DATA_DIR": str(tmp_path)}
    )
    assert json.loads(created.stdout)["keystore"] == str(tmp_path / "keystore.json")


def test_no_password_source_without_a_terminal(tmp_path: Path) -> None:
    assert_clean_failure(run("wallet", "new", "--keystore", str(tmp_path / "k.json")), "no password given")
    assert not (tmp_path / "k.json").exists()


def test_unwritable_directory_is_a_clean_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        blocked = tmp_path / "file-not-dir"
        blocked.write_text("")
        target = blocked / "k.json"  # a path under a regular file fails even for root
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "k.json"
    assert_clean_failure(
        run("wallet", "new", "--keystore", str(target), "--no-password", "--light-kdf"),
        "cannot write keystore",
    )


def test_help_and_version_do_not_import_heavy_libraries() -> None:
    probe = (
        "import sys; from prime_node.cli.main import build_app; from typer.testing import CliRunner;"
        "r = CliRunner().invoke(build_app(), ['--help']); assert r.exit_code == 0, r.output;"
        "heavy = ('torch', 'transformers', 'libp2p', 'trio', 'numpy', 'pydantic');"
        "heavy = sorted(m for m in heavy if m in sys.modules);"
        "print(','.join(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("prime-node ")
