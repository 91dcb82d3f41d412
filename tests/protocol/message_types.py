"""Every message type in the project, imported so that the codec registry is complete, plus test-only
types that exercise each field kind the codec supports."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Annotated

import prime_node.testing
import protocol
from crypto.keys import Address
from protocol.codec import ExactLen, IntRange, MaxLen, Message, message, registered_types

for module in pkgutil.walk_packages(protocol.__path__, prefix="protocol."):
    importlib.import_module(module.name)
# Hand-made strategies for types with cross-field invariants live in prime_node/testing/*_strategies.py.
for module in pkgutil.iter_modules(prime_node.testing.__path__, prefix="prime_node.testing."):
    if module.name.endswith("_strategies"):
        importlib.import_module(module.name)


@message("test.inner", max_bytes=4096)
@dataclass(frozen=True)
class Inner(Message):
    label: Annotated[str, MaxLen(32)]
    weight: float
    signer: Address | None


@message("test.everything", max_bytes=64 * 1024)
@dataclass(frozen=True)
class Everything(Message):
    flag: bool
    count: Annotated[int, IntRange(0, 1000)]
    big: int
    blob: Annotated[bytes, MaxLen(256)]
    name: str
    maybe: bytes | None
    digest: Annotated[bytes, ExactLen(4)]
    items: Annotated[tuple[Inner, ...], MaxLen(8)]
    numbers: tuple[int, ...]
    nested: Inner


ALL_TYPES = sorted(registered_types().items())
