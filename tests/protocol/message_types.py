"""Every message type in the project, imported so that the codec registry is complete, plus test-only
types that exercise each field kind the codec supports."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Annotated

import protocol
import tests.strategies
from crypto.keys import Address
from protocol.codec import ExactLen, IntRange, MaxLen, Message, message, registered_types

for module in pkgutil.walk_packages(protocol.__path__, prefix="protocol."):
    importlib.import_module(module.name)
# Hand-made strategies for types with cross-field invariants live in tests/strategies/.
for module in pkgutil.iter_modules(tests.strategies.__path__, prefix="tests.strategies."):
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
