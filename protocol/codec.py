"""The wire codec: typed messages ⇄ canonical msgpack frames.

A message type is a frozen dataclass registered with ``@message("name", max_bytes=...)``. Its field
annotations are its schema: ``int``, ``bool``, ``float``, ``str``, ``bytes``, ``Address``, another message
type, ``tuple[T, ...]`` and ``T | None``, with ``Annotated[..., MaxLen(n)]``, ``Annotated[bytes,
ExactLen(n)]`` or ``Annotated[int, IntRange(lo, hi)]`` bounds. The frame is
``[version, type name, [field values in declaration order]]``.

Decoding is strict, because every frame comes from an untrusted peer: the size cap is checked before
parsing, msgpack's own limits are set from it, every field's type and bound is checked, and the bytes must
be the one canonical encoding of the decoded value (so a message has exactly one byte form, and its hash
is a stable id). Any failure is a RemoteProtocolError; nothing else escapes.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, cast

import msgpack

from crypto.errors import CryptoError
from crypto.keys import ADDRESS_SIZE, Address
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

WIRE_VERSION = 1
DEFAULT_MAX_LEN = 1 << 16
_INT64 = (-(1 << 63), (1 << 64) - 1)


@dataclass(frozen=True)
class MaxLen:
    """Upper bound on the length of a ``bytes``, ``str`` or ``tuple`` field."""

    limit: int


@dataclass(frozen=True)
class ExactLen:
    """A ``bytes`` field of exactly this many bytes (hashes, ids, nonces, signatures)."""

    size: int


@dataclass(frozen=True)
class IntRange:
    """Inclusive bounds on an ``int`` field."""

    low: int
    high: int


class Message:
    """Base of every wire message type (see ``message``)."""

    TYPE: ClassVar[str]
    MAX_BYTES: ClassVar[int]


M = TypeVar("M", bound=Message)
_REGISTRY: dict[str, type[Message]] = {}


# ---------------------------------------------------------------------------------------------------------
# Schema: a tree of field codecs built once per message type from its annotations.


class _Field:
    """Validates one decoded msgpack value and turns it into the Python value (and back)."""

    def to_wire(self, value: Any) -> Any:
        return value

    def from_wire(self, value: Any, path: str) -> Any:
        raise NotImplementedError


def _bad(path: str, problem: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"field {path}: {problem}", reason="malformed")


@dataclass
class _IntField(_Field):
    low: int
    high: int

    def from_wire(self, value: Any, path: str) -> Any:
        if type(value) is not int:
            raise _bad(path, f"expected int, got {type(value).__name__}")
        if not self.low <= value <= self.high:
            raise _bad(path, f"{value} outside [{self.low}, {self.high}]")
        return value


class _BoolField(_Field):
    def from_wire(self, value: Any, path: str) -> Any:
        if type(value) is not bool:
            raise _bad(path, f"expected bool, got {type(value).__name__}")
        return value


class _FloatField(_Field):
    def to_wire(self, value: Any) -> Any:
        return float(value)

    def from_wire(self, value: Any, path: str) -> Any:
        if type(value) is not float:
            raise _bad(path, f"expected float, got {type(value).__name__}")
        if not math.isfinite(value):
            raise _bad(path, "float is not finite")
        return value


@dataclass
class _BytesField(_Field):
    max_len: int
    exact_len: int | None = None

    def from_wire(self, value: Any, path: str) -> Any:
        if type(value) is not bytes:
            raise _bad(path, f"expected bytes, got {type(value).__name__}")
        if self.exact_len is not None and len(value) != self.exact_len:
            raise _bad(path, f"{len(value)} bytes, expected exactly {self.exact_len}")
        if len(value) > self.max_len:
            raise _bad(path, f"{len(value)} bytes, more than {self.max_len}")
        return value


@dataclass
class _StrField(_Field):
    max_len: int

    def from_wire(self, value: Any, path: str) -> Any:
        if type(value) is not str:
            raise _bad(path, f"expected str, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise _bad(path, f"{len(value)} characters, more than {self.max_len}")
        return value


class _AddressField(_Field):
    def to_wire(self, value: Any) -> Any:
        return value.raw

    def from_wire(self, value: Any, path: str) -> Any:
        if type(value) is not bytes or len(value) != ADDRESS_SIZE:
            raise _bad(path, "expected a 20-byte address")
        return Address(value)


@dataclass
class _OptionalField(_Field):
    inner: _Field

    def to_wire(self, value: Any) -> Any:
        return None if value is None else self.inner.to_wire(value)

    def from_wire(self, value: Any, path: str) -> Any:
        return None if value is None else self.inner.from_wire(value, path)


@dataclass
class _TupleField(_Field):
    item: _Field
    max_len: int

    def to_wire(self, value: Any) -> Any:
        return [self.item.to_wire(v) for v in value]

    def from_wire(self, value: Any, path: str) -> Any:
        if type(value) is not list:
            raise _bad(path, f"expected array, got {type(value).__name__}")
        if len(value) > self.max_len:
            raise _bad(path, f"{len(value)} items, more than {self.max_len}")
        return tuple(self.item.from_wire(v, f"{path}[{i}]") for i, v in enumerate(value))


@dataclass
class _MessageField(_Field):
    cls: type[Message]

    def to_wire(self, value: Any) -> Any:
        return [f.to_wire(getattr(value, name)) for name, f in _schema(self.cls)]

    def from_wire(self, value: Any, path: str) -> Any:
        schema = _schema(self.cls)
        if type(value) is not list or len(value) != len(schema):
            raise _bad(path, f"expected a {len(schema)}-field {self.cls.TYPE} record")
        kwargs = {name: f.from_wire(v, f"{path}.{name}") for (name, f), v in zip(schema, value, strict=True)}
        try:
            return self.cls(**kwargs)
        except (ProtocolError, ValueError, CryptoError) as exc:  # __post_init__ invariants
            raise _bad(path, str(exc)) from exc


_SCHEMAS: dict[type[Message], list[tuple[str, _Field]]] = {}


def _schema(cls: type[Message]) -> list[tuple[str, _Field]]:
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls, include_extras=True)
        _SCHEMAS[cls] = [(f.name, _field_for(hints[f.name], cls)) for f in dataclasses.fields(cast(Any, cls))]
    return _SCHEMAS[cls]


def _field_for(annotation: Any, owner: type) -> _Field:
    bounds: list[Any] = []
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *bounds = typing.get_args(annotation)
    max_len = next((b.limit for b in bounds if isinstance(b, MaxLen)), DEFAULT_MAX_LEN)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"{owner.__name__}: only `T | None` unions are supported")
        return _OptionalField(_field_for(members[0], owner))
    if origin is tuple:
        item, ellipsis = typing.get_args(annotation)
        if ellipsis is not Ellipsis:
            raise TypeError(f"{owner.__name__}: tuples must be tuple[T, ...]")
        return _TupleField(_field_for(item, owner), max_len)
    if annotation is bool:
        return _BoolField()
    if annotation is int:
        bound = next((b for b in bounds if isinstance(b, IntRange)), IntRange(*_INT64))
        return _IntField(bound.low, bound.high)
    if annotation is float:
        return _FloatField()
    if annotation is bytes:
        exact = next((b.size for b in bounds if isinstance(b, ExactLen)), None)
        return _BytesField(max_len if exact is None else exact, exact)
    if annotation is str:
        return _StrField(max_len)
    if annotation is Address:
        return _AddressField()
    if isinstance(annotation, type) and issubclass(annotation, Message):
        return _MessageField(annotation)
    raise TypeError(f"{owner.__name__}: unsupported field type {annotation!r}")


def message(type_name: str, *, max_bytes: int) -> Callable[[type[M]], type[M]]:
    """Register a frozen dataclass as a wire message named ``type_name``, at most ``max_bytes`` encoded."""

    def register(cls: type[M]) -> type[M]:
        if type_name in _REGISTRY:
            raise TypeError(f"message type {type_name!r} registered twice")
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        cls.TYPE = type_name
        cls.MAX_BYTES = max_bytes
        _schema(cls)  # fail at import time on an unsupported annotation
        _REGISTRY[type_name] = cls
        return cls

    return register


def registered_types() -> dict[str, type[Message]]:
    """Every message type known to the codec (for tests and docs)."""
    return dict(_REGISTRY)


# ---------------------------------------------------------------------------------------------------------
# Frames


def encode(msg: Message) -> bytes:
    """The canonical frame of ``msg``. LocalProtocolError if it breaks its own type's bounds."""
    cls = type(msg)
    if _REGISTRY.get(getattr(cls, "TYPE", "")) is not cls:
        raise LocalProtocolError(f"{cls.__name__} is not a registered message type", reason="unregistered")
    body = _MessageField(cls).to_wire(msg)
    frame: bytes = msgpack.packb([WIRE_VERSION, cls.TYPE, body], use_bin_type=True)
    try:
        _MessageField(cls).from_wire(body, cls.TYPE)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(
            f"refusing to encode an invalid {cls.TYPE}: {exc}", reason=exc.reason
        ) from exc
    if len(frame) > cls.MAX_BYTES:
        raise LocalProtocolError(
            f"{cls.TYPE} encodes to {len(frame)} bytes, more than its cap of {cls.MAX_BYTES}",
            reason="too_large",
        )
    return frame


def decode(data: bytes, expected: type[M]) -> M:
    """Parse one frame that must hold an ``expected`` message. Only RemoteProtocolError escapes."""
    found = decode_any(data, max_bytes=expected.MAX_BYTES)
    if not isinstance(found, expected):
        raise RemoteProtocolError(
            f"expected a {expected.TYPE} message, got {found.TYPE}", reason="wrong_type"
        )
    return found


def decode_any(data: bytes, *, max_bytes: int | None = None) -> Message:
    """Parse one frame of any registered type (bounded by ``max_bytes`` or the largest type's cap)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RemoteProtocolError("frame is not bytes", reason="malformed")
    data = bytes(data)
    limit = max_bytes if max_bytes is not None else max((c.MAX_BYTES for c in _REGISTRY.values()), default=0)
    if len(data) > limit:
        raise RemoteProtocolError(f"frame of {len(data)} bytes exceeds {limit}", reason="too_large")
    raw = _unpack(data, limit)
    if type(raw) is not list or len(raw) != 3:
        raise RemoteProtocolError("frame is not [version, type, body]", reason="malformed")
    version, type_name, body = raw
    if type(version) is not int or version != WIRE_VERSION:
        raise RemoteProtocolError(f"unsupported wire version {version!r}", reason="bad_version")
    if type(type_name) is not str or type_name not in _REGISTRY:
        raise RemoteProtocolError(f"unknown message type {str(type_name)[:40]!r}", reason="unknown_type")
    cls = _REGISTRY[type_name]
    if len(data) > cls.MAX_BYTES:
        raise RemoteProtocolError(
            f"{type_name} frame of {len(data)} bytes exceeds {cls.MAX_BYTES}", reason="too_large"
        )
    msg: Message = _MessageField(cls).from_wire(body, type_name)
    if encode(msg) != data:
        raise RemoteProtocolError(f"{type_name} frame is not in canonical form", reason="non_canonical")
    return msg


def _reject_ext(code: int, data: bytes) -> Any:
    raise RemoteProtocolError("msgpack extension types are not part of the protocol", reason="malformed")


def _unpack(data: bytes, limit: int) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            timestamp=0,
            ext_hook=_reject_ext,
            max_bin_len=limit,
            max_str_len=limit,
            max_array_len=min(limit, 1 << 20),
            max_map_len=0,
            max_ext_len=0,
        )
    except RemoteProtocolError:
        raise
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, RecursionError) as exc:
        # msgpack reports truncation, junk, bad UTF-8 and limit breaches as ValueError subclasses.
        raise RemoteProtocolError(f"not a msgpack frame: {type(exc).__name__}", reason="malformed") from exc
