"""Sample filters on a sample's json metadata and caption, shared by ``sdtrain prepare`` and training.

A filter spec maps a name to a condition::

    {"pwatermark": "<=0.5", "punsafe": "<0.1", "status": "success", "min_width": 256, "max_aspect": 2}

- A json metadata field with a comparison: ``">=N"``, ``"<=N"``, ``">N"``, ``"<N"`` (numbers only),
  ``"==V"`` (also ``"=V"``), ``"!=V"``, or a plain value meaning ``==``. A number compares numerically
  (numeric strings in the metadata, as metadata.csv gives them, count as numbers); anything else compares
  as text.
- Shortcuts: ``min_width`` / ``min_height`` (pixels; the ``width``/``height`` field, else img2dataset's
  ``original_width``/``original_height``), ``min_aspect`` / ``max_aspect`` (width / height, from the same
  fields), ``min_caption_length`` / ``max_caption_length`` (characters of the caption).

``Filters.check(meta, caption)`` returns None when the sample passes, else the reason of the first filter
(in spec order) that rejected it:

- ``"NAME"`` — the value failed the condition,
- ``"NAME: missing"`` — the field the filter needs is absent, null or an empty string,
- ``"NAME: not a number"`` — a numeric condition met a value that is not a number.

A sample missing a field a filter needs is therefore rejected, never silently let through.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sdtrain.errors import UserError

FORMS = (
    "accepted forms: FIELD: '>=N', '<=N', '>N', '<N', '==V' (or '=V'), '!=V' or a plain value (==); "
    "min_width, min_height, min_caption_length, max_caption_length: an integer >= 0; "
    "min_aspect, max_aspect: a number > 0"
)

# Longest operators first, so ">=" is not read as ">" followed by "=5".
_OPS: tuple[tuple[str, Callable[[Any, Any], bool]], ...] = (
    (">=", operator.ge),
    ("<=", operator.le),
    ("==", operator.eq),
    ("!=", operator.ne),
    (">", operator.gt),
    ("<", operator.lt),
    ("=", operator.eq),
)
_ORDERING = {">=", "<=", ">", "<"}

_SIZE_FIELDS = {"width": ("width", "original_width"), "height": ("height", "original_height")}
SHORTCUTS = ("min_width", "min_height", "min_aspect", "max_aspect", "min_caption_length", "max_caption_length")


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a (non-bool) number or a numeric string, else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _bad(key: str, value: Any, why: str) -> UserError:
    return UserError(f"filter {key!r}: {why} (got {value!r}); {FORMS}")


@dataclass(frozen=True)
class Filter:
    """One condition. ``kind`` is ``"field"``, ``"size"``, ``"aspect"`` or ``"caption"``."""

    name: str
    kind: str
    op: str
    value: Any
    field: str = ""

    def describe(self) -> str:
        """The condition as written on the command line, e.g. ``"pwatermark<=0.5"`` or ``"min_width=256"``."""
        value = self.value
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        if self.kind == "field":
            return f"{self.field}{self.op}{value}"
        return f"{self.name}={value}"

    def check(self, meta: Mapping[str, Any], caption: str) -> str | None:
        if self.kind == "caption":
            length = len(caption or "")
            ok = length >= self.value if self.op == ">=" else length <= self.value
            return None if ok else self.name
        if self.kind == "size":
            value = _size(meta, self.field)
            if isinstance(value, str):
                return f"{self.name}: {value}"
            return None if value >= self.value else self.name
        if self.kind == "aspect":
            width, height = _size(meta, "width"), _size(meta, "height")
            for v in (width, height):
                if isinstance(v, str):
                    return f"{self.name}: {v}"
            assert isinstance(width, float) and isinstance(height, float)
            if height <= 0:
                return f"{self.name}: not a number"
            ratio = width / height
            ok = ratio >= self.value if self.op == ">=" else ratio <= self.value
            return None if ok else self.name
        value = meta.get(self.field)
        if _missing(value):
            return f"{self.name}: missing"
        compare = dict(_OPS)[self.op]
        if isinstance(self.value, float):
            number = _number(value)
            if number is None or math.isnan(number):
                return f"{self.name}: not a number"
            return None if compare(number, self.value) else self.name
        return None if compare(str(value), self.value) else self.name


def _size(meta: Mapping[str, Any], which: str) -> float | str:
    """Width or height from ``which`` or its img2dataset ``original_`` twin; a reason string when unusable."""
    for field in _SIZE_FIELDS[which]:
        value = meta.get(field)
        if not _missing(value):
            number = _number(value)
            return "not a number" if number is None or math.isnan(number) else number
    return "missing"


class Filters:
    """An ordered set of filters; empty filters accept everything (``bool(filters)`` is False)."""

    def __init__(self, filters: tuple[Filter, ...] = ()) -> None:
        self.filters = tuple(filters)

    def __bool__(self) -> bool:
        return bool(self.filters)

    def __len__(self) -> int:
        return len(self.filters)

    def __repr__(self) -> str:
        return f"Filters({', '.join(f.describe() for f in self.filters)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Filters) and self.filters == other.filters

    def __hash__(self) -> int:
        return hash(self.filters)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.filters]

    def describe(self, reason: str) -> str:
        """The condition behind a reason returned by ``check``, e.g. ``"pwatermark<=0.5"``.

        Reasons with a detail (``"pwatermark: missing"``) are returned as they are.
        """
        if ": " in reason:
            return reason
        name = reason.split(":", 1)[0]
        for f in self.filters:
            if f.name == name:
                return f.describe()
        return reason

    def check(self, meta: Mapping[str, Any], caption: str) -> str | None:
        """None when the sample passes every filter, else the reason of the first one that rejected it."""
        for f in self.filters:
            reason = f.check(meta, caption)
            if reason is not None:
                return reason
        return None


def _parse_shortcut(key: str, raw: Any) -> Filter:
    if isinstance(raw, bool) or raw is None:
        raise _bad(key, raw, "needs a number")
    number = _number(raw)
    if number is None or math.isnan(number) or math.isinf(number):
        raise _bad(key, raw, "needs a number")
    if key in ("min_aspect", "max_aspect"):
        if number <= 0:
            raise _bad(key, raw, "needs a number > 0")
        return Filter(key, "aspect", ">=" if key == "min_aspect" else "<=", number)
    if number < 0 or number != int(number):
        raise _bad(key, raw, "needs an integer >= 0")
    if key in ("min_width", "min_height"):
        return Filter(key, "size", ">=", float(number), field=key[4:])
    return Filter(key, "caption", ">=" if key == "min_caption_length" else "<=", int(number))


def _parse_condition(key: str, raw: Any) -> Filter:
    if raw is None:
        raise _bad(key, raw, "needs a condition")
    if isinstance(raw, (bool, int, float)):
        number = _number(raw)
        assert number is not None
        if math.isnan(number):
            raise _bad(key, raw, "NaN never compares equal")
        return Filter(key, "field", "==", number, field=key)
    if not isinstance(raw, str):
        raise _bad(key, raw, "needs a condition string or a plain value")
    text = raw.strip()
    op = next((symbol for symbol, _ in _OPS if text.startswith(symbol)), None)
    if op is None:
        if text[:1] in ("<", ">", "!"):
            raise _bad(key, raw, "unknown comparison")
        op, operand = "==", text
    else:
        operand = text[len(op):].strip()
    if not operand:
        raise _bad(key, raw, "the condition has no value")
    if operand[:1] in ("<", ">", "=", "!"):
        raise _bad(key, raw, "unknown comparison")
    number = _number(operand)
    if number is not None and math.isnan(number):
        number = None
    if op in _ORDERING and number is None:
        raise _bad(key, raw, f"'{op}' needs a number")
    return Filter(key, "field", "==" if op == "=" else op, operand if number is None else number, field=key)


def parse_filters(spec: Mapping[str, Any] | None) -> Filters:
    """Parse ``{name: condition}`` (see the module docstring) into ``Filters``, in the spec's order.

    Raises UserError (one line naming the key and listing the accepted forms) on a condition it can't read.
    """
    if spec is None:
        return Filters()
    if not isinstance(spec, Mapping):
        raise UserError(f"filters: expected a mapping of field to condition, got {type(spec).__name__}; {FORMS}")
    filters = []
    for key, raw in spec.items():
        if not isinstance(key, str) or not key.strip():
            raise _bad(str(key), raw, "needs a field name")
        key = key.strip()
        filters.append(_parse_shortcut(key, raw) if key in SHORTCUTS else _parse_condition(key, raw))
    return Filters(tuple(filters))
