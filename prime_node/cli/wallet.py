"""``prime-node wallet``: the node's identity — a secp256k1 key in an Ethereum keystore v3 file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prime_node.cli.options import (
    JsonOption,
    KeystoreOption,
    LightKdfOption,
    NoPasswordOption,
    PasswordEnvOption,
    PasswordFileOption,
)
from prime_node.paths import default_keystore_path

if TYPE_CHECKING:
    from crypto.keys import WalletKey

wallet_app = typer.Typer(
    help="Create and use the node's wallet key (its Ethereum address and libp2p identity).",
    no_args_is_help=True,
)

MessageArgument = Annotated[str, typer.Argument(help="The message: UTF-8 text, or 0x-hex bytes with --hex.")]
HexOption = Annotated[bool, typer.Option("--hex", help="MESSAGE is 0x-prefixed hex bytes, not text.")]


def register(app: typer.Typer) -> None:
    app.add_typer(wallet_app, name="wallet")


def _keystore_path(keystore: Path | None) -> Path:
    return keystore if keystore is not None else default_keystore_path()


def _message_bytes(message: str, as_hex: bool) -> bytes:
    if not as_hex:
        return message.encode("utf-8")
    from crypto.signatures import parse_hex_bytes

    return parse_hex_bytes(message, what="message")


def _print_identity(key: WalletKey, path: Path, as_json: bool) -> None:
    from crypto.identity import peer_id_from_public_key

    identity = {
        "address": str(key.address),
        "peer_id": peer_id_from_public_key(key.public_key),
        "keystore": str(path),
    }
    if as_json:
        typer.echo(json.dumps(identity))
    else:
        typer.echo(f"address  {identity['address']}\npeer id  {identity['peer_id']}\nkeystore {path}")


@wallet_app.command("new")
def new(
    keystore: KeystoreOption = None,
    password_file: PasswordFileOption = None,
    password_env: PasswordEnvOption = None,
    no_password: NoPasswordOption = False,
    light_kdf: LightKdfOption = False,
    as_json: JsonOption = False,
) -> None:
    """Create a new key and write it as an encrypted keystore (mode 0600). Never overwrites a file."""
    from crypto.keys import WalletKey
    from prime_node.wallet_store import LIGHT_SCRYPT, PasswordSource, create_keystore

    path = _keystore_path(keystore)
    password = PasswordSource(password_file, password_env, no_password).resolve(confirm=True)
    key = WalletKey.generate()
    if light_kdf:
        create_keystore(path, key, password, scrypt=LIGHT_SCRYPT)
    else:
        create_keystore(path, key, password)
    if not as_json:
        typer.echo(f"created keystore {path}")
    _print_identity(key, path, as_json)


@wallet_app.command("show")
def show(
    keystore: KeystoreOption = None,
    password_file: PasswordFileOption = None,
    password_env: PasswordEnvOption = None,
    no_password: NoPasswordOption = False,
    as_json: JsonOption = False,
) -> None:
    """Print the wallet's EIP-55 address and libp2p peer ID (unlocks the keystore to derive the peer ID)."""
    from prime_node.wallet_store import PasswordSource, unlock_keystore

    path = _keystore_path(keystore)
    key = unlock_keystore(path, PasswordSource(password_file, password_env, no_password).resolve())
    _print_identity(key, path, as_json)


@wallet_app.command("sign")
def sign(
    message: MessageArgument,
    as_hex: HexOption = False,
    keystore: KeystoreOption = None,
    password_file: PasswordFileOption = None,
    password_env: PasswordEnvOption = None,
    no_password: NoPasswordOption = False,
) -> None:
    """Sign MESSAGE as Ethereum wallets do (EIP-191 personal_sign); print the 65-byte signature in hex."""
    from crypto.signatures import sign_message
    from prime_node.wallet_store import PasswordSource, unlock_keystore

    payload = _message_bytes(message, as_hex)
    key = unlock_keystore(
        _keystore_path(keystore), PasswordSource(password_file, password_env, no_password).resolve()
    )
    typer.echo("0x" + sign_message(key, payload).hex())


@wallet_app.command("verify")
def verify(
    message: MessageArgument,
    signature: Annotated[str, typer.Argument(help="0x-hex 65-byte signature (r‖s‖v).")],
    address: Annotated[str, typer.Argument(help="The Ethereum address expected to have signed.")],
    as_hex: HexOption = False,
) -> None:
    """Check an EIP-191 signature. Exit status 0 if ADDRESS signed MESSAGE, 1 if not."""
    from crypto.errors import CryptoError
    from crypto.keys import Address
    from crypto.signatures import SIGNATURE_SIZE, eip191_digest, parse_hex_bytes, recover_address

    expected = Address.parse(address)
    payload = _message_bytes(message, as_hex)
    raw_signature = parse_hex_bytes(signature, size=SIGNATURE_SIZE, what="signature")
    try:
        signer = recover_address(eip191_digest(payload), raw_signature, strict=False)
    except CryptoError as exc:
        typer.echo(f"invalid: {exc}", err=True)
        raise typer.Exit(1) from exc
    if signer != expected:
        typer.echo(f"invalid: signed by {signer}, not {expected}", err=True)
        raise typer.Exit(1)
    typer.echo(f"valid: signed by {expected}")
