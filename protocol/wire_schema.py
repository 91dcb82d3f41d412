"""The codec's schema of each message as text, in docs/protocol.md's notation.

docs/protocol.md is the wire specification: a table per message, a row per field in encoding order. The
rows are compared with what this module reads from the codec's own schema tree (the one ``encode`` and
``decode`` walk), not with a second reading of the annotations, so a field the codec encodes cannot be
missing from the page or described with another type or bound (tests/protocol/test_protocol_doc.py).

Notation (also explained at the top of the page): ``int[lo, hi]`` (inclusive bounds; ``int`` alone is any
msgpack integer, -2^63 … 2^64-1), ``bool``, ``float`` (finite), ``str≤n`` (characters), ``bytes≤n`` /
``bytes[n]`` (at most / exactly n bytes), ``address`` (20 bytes), ``[T]≤n`` (an array of at most n),
``T?`` (nil or T), and a message type's name for a nested record (an array of its fields). Numbers of
2^20 and more that sit next to a power of two are written as one (``2^63-1``); sizes in bytes as
MiB/KiB/B sums (``64 MiB + 1 KiB``).
"""

from __future__ import annotations

from dataclasses import dataclass

# The codec's field classes are private to it on purpose (nothing else builds schemas); this module only
# reads the tree the codec built, so what it describes is what the codec encodes.
from protocol.codec import (
    _INT64,
    Message,
    _AddressField,
    _BoolField,
    _BytesField,
    _Field,
    _FloatField,
    _IntField,
    _MessageField,
    _OptionalField,
    _schema,
    _StrField,
    _TupleField,
)

_BIG = 1 << 20


@dataclass(frozen=True)
class FieldSpec:
    """One field of a message as the wire spec writes it."""

    name: str
    type: str


def message_fields(cls: type[Message]) -> tuple[FieldSpec, ...]:
    """The fields of ``cls`` in encoding order, each with its type and bounds in the page's notation."""
    return tuple(FieldSpec(name, type_text(field)) for name, field in _schema(cls))


def type_text(field: _Field) -> str:
    """One field codec in the page's notation (see the module doc)."""
    if isinstance(field, _IntField):
        if (field.low, field.high) == _INT64:
            return "int"
        return f"int[{number_text(field.low)}, {number_text(field.high)}]"
    if isinstance(field, _BoolField):
        return "bool"
    if isinstance(field, _FloatField):
        return "float"
    if isinstance(field, _BytesField):
        if field.exact_len is not None:
            return f"bytes[{field.exact_len}]"
        return f"bytes≤{length_text(field.max_len)}"
    if isinstance(field, _StrField):
        return f"str≤{field.max_len}"
    if isinstance(field, _AddressField):
        return "address"
    if isinstance(field, _OptionalField):
        return f"{type_text(field.inner)}?"
    if isinstance(field, _TupleField):
        return f"[{type_text(field.item)}]≤{field.max_len}"
    if isinstance(field, _MessageField):
        return field.cls.TYPE
    raise TypeError(f"no notation for the codec field {type(field).__name__}")


def number_text(value: int) -> str:
    """``2^k`` or ``2^k-1`` for large numbers at a power of two (bounds read better so), else decimal."""
    if value >= _BIG and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    if value + 1 >= _BIG and (value + 1) & value == 0:
        return f"2^{value.bit_length()}-1"
    if value < 0 and -value >= _BIG and -value & (-value - 1) == 0:
        return f"-2^{(-value).bit_length() - 1}"
    return str(value)


def size_text(size: int) -> str:
    """A size in bytes as a sum of MiB, KiB and B (``64 MiB + 1 KiB``, ``16 MiB + 128 B``, ``512 B``)."""
    parts = [(size >> 20, "MiB"), ((size >> 10) & 1023, "KiB"), (size & 1023, "B")]
    return " + ".join(f"{count} {unit}" for count, unit in parts if count) or "0 B"


def length_text(size: int) -> str:
    """A ``bytes`` field's bound: a plain count under 1 KiB (``bytes≤32``), else as ``size_text``."""
    return str(size) if size < 1024 else size_text(size)
