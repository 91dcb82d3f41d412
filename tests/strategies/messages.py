"""Hypothesis strategies for wire messages, derived from each message type's annotations.

``message_strategy(cls)`` covers any registered type without hand-written generators, so the codec's
round-trip and fuzz properties hold for every message the project defines. A type whose ``__post_init__``
enforces cross-field invariants that random values rarely meet registers a hand-made strategy with
``register_strategy`` from a module in tests/strategies/: the codec's property tests import every
module there.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, cast

from hypothesis import strategies as st

from crypto.errors import CryptoError
from crypto.keys import ADDRESS_SIZE, Address
from protocol.codec import ExactLen, IntRange, MaxLen, Message
from protocol.errors import ProtocolError

# Generated collections are kept far below the wire caps: the point is structure, not volume.
_GENERATED_MAX_LEN = 24
_CUSTOM: dict[type[Message], st.SearchStrategy[Any]] = {}


def register_strategy(cls: type[Message], strategy: st.SearchStrategy[Any]) -> None:
    _CUSTOM[cls] = strategy


def message_strategy(cls: type[Message]) -> st.SearchStrategy[Any]:
    if cls in _CUSTOM:
        return _CUSTOM[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: _value_strategy(hints[f.name]) for f in dataclasses.fields(cast(Any, cls))}
    return (
        st.fixed_dictionaries(fields)
        .map(lambda kwargs: _build_or_none(cls, kwargs))
        .filter(lambda built: built is not None)
    )


def _build_or_none(cls: type[Message], kwargs: dict[str, Any]) -> Message | None:
    try:
        return cls(**kwargs)
    except (ValueError, CryptoError, ProtocolError):
        return None


def _value_strategy(annotation: Any) -> st.SearchStrategy[Any]:
    bounds: list[Any] = []
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *bounds = typing.get_args(annotation)
    max_len = min(
        next((b.limit for b in bounds if isinstance(b, MaxLen)), _GENERATED_MAX_LEN), _GENERATED_MAX_LEN
    )
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        (member,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return st.none() | _value_strategy(member)
    if origin is tuple:
        item, _ = typing.get_args(annotation)
        return st.lists(_value_strategy(item), max_size=max_len).map(tuple)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        bound = next((b for b in bounds if isinstance(b, IntRange)), IntRange(-(1 << 63), (1 << 64) - 1))
        return st.integers(bound.low, bound.high)
    if annotation is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if annotation is bytes:
        exact = next((b.size for b in bounds if isinstance(b, ExactLen)), None)
        return st.binary(max_size=max_len) if exact is None else st.binary(min_size=exact, max_size=exact)
    if annotation is str:
        return st.text(max_size=max_len)
    if annotation is Address:
        return st.binary(min_size=ADDRESS_SIZE, max_size=ADDRESS_SIZE).map(Address)
    if isinstance(annotation, type) and issubclass(annotation, Message):
        return message_strategy(annotation)
    raise TypeError(f"no strategy for {annotation!r}")
