"""A run config's problems in the project's words, all at once.

pydantic reports what it found in its own phrasing, and the loader used to show only the first problem:
an operator with two typos fixed one, restarted, and met the second. ``describe_problems`` turns a
ValidationError into one line that lists every unknown key first (each with a "did you mean" from the
model's own field names, including a key written in the wrong section), then every missing field, then
each bad value with what it must be.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from protocol.names import NAME_PATTERN, NAME_RULE

KeyPath = tuple[str | int, ...]
"""Where a value sits in the config: section and field names, and list indices."""

SUGGEST_CUTOFF = 0.6
"""difflib similarity a field name needs to be offered as "did you mean" (its default: typos, not guesses)."""
MAX_SHOWN_CHARS = 40
"""A bad value or odd key is quoted up to this many characters: a config may come from the network."""
MAX_LISTED = 12
"""Problems named in the message; the rest are counted."""

_PATTERN_RULES = {
    r"^0x[0-9a-fA-F]{40}$": "must be an Ethereum address: 0x and 40 hex digits",
    NAME_PATTERN: NAME_RULE,
}


def dotted(path: Iterable[str | int]) -> str:
    """``task.kind``, ``trusted_validators[1]``; a key that is no plain name is quoted (and cut)."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
            continue
        name = part if part.isprintable() and 0 < len(part) <= 64 and " " not in part else _shown(part)
        text += f".{name}" if text else name
    return text or "(root)"


def _sub_model(model: type[BaseModel] | None, name: str) -> type[BaseModel] | None:
    if model is None or name not in model.model_fields:
        return None
    annotation = model.model_fields[name].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _locate(model: type[BaseModel], loc: Sequence[str | int]) -> KeyPath:
    """The config path an error concerns: pydantic's location without the union member it names after
    a field that is no section (``checkpoint_every``, ``constrained-int``)."""
    path: list[str | int] = []
    current: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):
            current = None
        elif current is not None:
            current = _sub_model(current, part)
        elif path and not isinstance(path[-1], int):
            break
        path.append(part)
    return tuple(path)


def _sections(model: type[BaseModel], prefix: KeyPath = ()) -> Iterable[tuple[KeyPath, type[BaseModel]]]:
    yield prefix, model
    for name in model.model_fields:
        sub = _sub_model(model, name)
        if sub is not None:
            yield from _sections(sub, (*prefix, name))


def suggestion(model: type[BaseModel], parent: KeyPath, key: str) -> str | None:
    """The field ``key`` was probably meant to be, under section ``parent`` of ``model``: a close name in
    the same section, else the same name in another section (``digits`` at the top is ``task.digits``)."""
    if len(key) > 64:
        return None  # no field is that long; and difflib's cost grows with it
    sections = dict(_sections(model))
    section = sections.get(parent)
    if section is not None:
        close = difflib.get_close_matches(key.lower(), list(section.model_fields), n=1, cutoff=SUGGEST_CUTOFF)
        if close:
            return dotted((*parent, close[0]))
    for path, other in sections.items():
        if path != parent and key.lower() in other.model_fields:
            where = f"under [{dotted(path)}]" if path else "at the top, before any [section]"
            return f"{dotted((*path, key.lower()))}, {where}"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 1] + "…"


def _rule(error: ErrorDetails) -> str:
    """What the value must be, in our words (pydantic's message for a kind we have no words for)."""
    kind = error["type"]
    ctx: Mapping[str, Any] = error.get("ctx") or {}
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    bounds = {
        "greater_than_equal": ("ge", "at least"),
        "greater_than": ("gt", "greater than"),
        "less_than_equal": ("le", "at most"),
        "less_than": ("lt", "less than"),
    }
    if kind in bounds:
        key, words = bounds[kind]
        return f"must be {words} {ctx.get(key)}"
    if kind == "literal_error":
        return f"must be {ctx.get('expected')}"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern"))
        return _PATTERN_RULES.get(pattern, f"must match {pattern}")
    if kind in ("too_short", "too_long"):
        size = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"must have {'at least' if kind == 'too_short' else 'at most'} {size} items"
    simple = {
        "int_parsing": "must be a whole number",
        "int_type": "must be a whole number",
        "int_from_float": "must be a whole number",
        "float_parsing": "must be a number",
        "float_type": "must be a number",
        "bool_parsing": "must be true or false",
        "bool_type": "must be true or false",
        "string_type": "must be a string",
        "model_type": "must be a table of settings",
        "model_attributes_type": "must be a table of settings",
        "dict_type": "must be a table of settings",
        "list_type": "must be a list",
        "tuple_type": "must be a list",
        "path_type": "must be a path (a string)",
    }
    return simple.get(kind, error["msg"])


def _joined_rules(rules: Sequence[str]) -> str:
    unique = list(dict.fromkeys(rules))
    if len(unique) > 1 and all(rule.startswith("must be ") for rule in unique):
        return "must be " + " or ".join(rule.removeprefix("must be ") for rule in unique)
    return " or ".join(unique)


@dataclass(frozen=True)
class Problems:
    """What is wrong with a config: the first ``MAX_LISTED`` problems in words, and how many there are."""

    shown: tuple[str, ...]
    total: int

    def line(self, source: str) -> str:
        """``run.toml: 2 problems: …; …`` (one line: the CLI prints it after ``error:``)."""
        more = [f"and {self.total - len(self.shown)} more"] if self.total > len(self.shown) else []
        if self.total == 1:
            return f"{source}: {self.shown[0]}"
        return f"{source}: {self.total} problems: " + "; ".join([*self.shown, *more])


def describe_problems(
    exc: ValidationError,
    *,
    model: type[BaseModel],
    origins: Mapping[KeyPath, str] | None = None,
    limit: int = MAX_LISTED,
) -> Problems:
    """Unknown keys first (top-level ones before sections'), then missing fields, then bad values, at most
    ``limit`` of them in words (a config from the network may hold thousands of keys: each guess costs a
    difflib pass). ``origins`` names where a key came from when not the file (an environment variable)."""
    origins = origins or {}
    unknown: list[KeyPath] = []
    missing: list[str] = []
    bad: dict[KeyPath, tuple[list[str], Any]] = {}
    for error in exc.errors():
        path = _locate(model, error["loc"])
        if error["type"] == "extra_forbidden" and path and isinstance(path[-1], str):
            unknown.append(path)
        elif error["type"] == "missing":
            missing.append(dotted(path))
        else:
            rules, _ = bad.setdefault(path, ([], error.get("input")))
            rules.append(_rule(error))
    unknown.sort(key=len)
    total = len(unknown) + bool(missing) + len(bad)
    shown = [_unknown(model, path, origins) for path in unknown[:limit]]
    if missing:
        shown.append(f"missing required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    for path, (rules, value) in bad.items():
        got = "" if isinstance(value, dict | list | tuple) else f" (got {_shown(value)})"
        label = f"field {dotted(path)}: " if path else ""
        origin = f" [from {origins[path]}]" if path in origins else ""
        shown.append(f"{label}{_joined_rules(rules)}{got}{origin}")
    return Problems(tuple(shown[:limit]), total)


def _unknown(model: type[BaseModel], path: KeyPath, origins: Mapping[KeyPath, str]) -> str:
    notes = [f"from {origins[path]}"] if path in origins else []
    guess = suggestion(model, path[:-1], str(path[-1]))
    if guess is not None:
        notes.append(f"did you mean {guess}?")
    return f"unknown field {dotted(path)}" + (f" ({'; '.join(notes)})" if notes else "")


def env_origins(tree: Mapping[str, Any], prefix: str, path: KeyPath = ()) -> dict[KeyPath, str]:
    """For each leaf of an environment-override tree, the variable that set it."""
    found: dict[KeyPath, str] = {}
    for key, value in tree.items():
        here = (*path, key)
        if isinstance(value, Mapping):
            found.update(env_origins(value, prefix, here))
        else:
            found[here] = prefix + "__".join(str(part).upper() for part in here)
    return found
