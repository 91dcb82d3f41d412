"""Option types shared by several commands, so each flag is spelled and documented once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

KeystoreOption = Annotated[
    Path | None,
    typer.Option(
        "--keystore",
        help="Keystore file. Default: $PRIME_NODE_KEYSTORE, else keystore.json in the user data dir.",
        dir_okay=False,
    ),
]
PasswordFileOption = Annotated[
    Path | None,
    typer.Option(
        "--password-file", help="Read the password from the first line of this file.", dir_okay=False
    ),
]
PasswordEnvOption = Annotated[
    str | None,
    typer.Option("--password-env", metavar="VAR", help="Read the password from this environment variable."),
]
NoPasswordOption = Annotated[bool, typer.Option("--no-password", help="Use an empty password.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
LightKdfOption = Annotated[
    bool, typer.Option("--light-kdf", help="Weak, fast scrypt (n=2^12) for tests and throwaway wallets.")
]
KeepBatchesOption = Annotated[
    int,
    typer.Option(
        "--keep-batches",
        min=0,
        max=1_000_000,
        metavar="N",
        help="Keep the newest N signed rollout batches this node sees, as received, in DATA_DIR/batches/ "
        "(check one with `prime-node validate DATA_DIR/batches/FILE`); 0 = off.",
    ),
]
