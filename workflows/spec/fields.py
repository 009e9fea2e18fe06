"""Typed, strict access to one JSON object of the trial spec, naming fields by their JSON path.

Every getter checks the type and range and raises `SpecError(path, what to send)`; `done()`
rejects keys nobody asked for, so a misspelt field ("warmpu") is an error rather than a
silently applied default. Pure: safe inside Temporal's workflow sandbox.
"""

from __future__ import annotations

import math
import re
from typing import Any

_MISSING: Any = object()


class SpecError(ValueError):
    """A spec field is missing, of the wrong type or out of range; `field` is its JSON path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__


class Fields:
    """One JSON object at `path` (e.g. "paths[1]"); remembers which keys were read."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            raise SpecError(path or "spec", f"must be a JSON object, got {_kind(data)}")
        self.data: dict[str, Any] = data
        self.path = path
        self.seen: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def _get(self, key: str, default: Any) -> Any:
        self.seen.add(key)
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise SpecError(self.at(key), "is required")
            return default
        return value

    def text(self, key: str, default: Any = _MISSING) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise SpecError(self.at(key), f"must be a string, got {_kind(value)}")
        return value

    def name(self, key: str, pattern: re.Pattern[str]) -> str:
        value = self.text(key)
        if not pattern.match(value):
            raise SpecError(self.at(key), f"{value!r} is not a valid name (letters, digits, . _ -; up to 63)")
        return value

    def choice(self, key: str, options: tuple[str, ...], default: Any = _MISSING) -> str:
        value = self.text(key, default)
        if value not in options:
            raise SpecError(self.at(key), f"{value!r} is not one of {', '.join(options)}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise SpecError(self.at(key), f"must be true or false, got {_kind(value)}")
        return value

    def number(self, key: str, default: Any = _MISSING, minimum: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecError(self.at(key), f"must be a finite number, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise SpecError(self.at(key), f"must be >= {minimum:g}, got {value:g}")
        return float(value)

    def integer(self, key: str, default: Any = _MISSING, minimum: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # the Temporal UI and JavaScript send 10.0 for 10
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(self.at(key), f"must be an integer, got {_kind(value)}")
        if minimum is not None and value < minimum:
            raise SpecError(self.at(key), f"must be >= {minimum}, got {value}")
        return value

    def items(self, key: str, default: Any = _MISSING) -> list[Any]:
        value = self._get(key, default)
        if not isinstance(value, list):
            raise SpecError(self.at(key), f"must be a list, got {_kind(value)}")
        return value

    def ints(self, key: str, default: Any = _MISSING, minimum: int = 0) -> list[int]:
        out = []
        for i, item in enumerate(self.items(key, default)):
            if isinstance(item, float) and item.is_integer():
                item = int(item)
            if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
                raise SpecError(f"{self.at(key)}[{i}]", f"must be an integer >= {minimum}, got {item!r}")
            out.append(item)
        return out

    def strs(self, key: str, default: Any = _MISSING, options: tuple[str, ...] = ()) -> list[str]:
        out = []
        for i, item in enumerate(self.items(key, default)):
            if not isinstance(item, str) or (options and item not in options):
                allowed = f"one of {', '.join(options)}" if options else "a string"
                raise SpecError(f"{self.at(key)}[{i}]", f"must be {allowed}, got {item!r}")
            out.append(item)
        return out

    def obj(self, key: str) -> Fields:
        self.seen.add(key)
        return Fields(self.data.get(key, {}) if self.data.get(key) is not None else {}, self.at(key))

    def objects(self, key: str, default: Any = _MISSING) -> list[Fields]:
        return [Fields(item, f"{self.at(key)}[{i}]") for i, item in enumerate(self.items(key, default))]

    def done(self) -> None:
        """Reject keys that no getter read (misspellings, fields from another version)."""
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            known = ", ".join(sorted(self.seen))
            raise SpecError(self.at(unknown[0]), f"is not a known field here; known fields: {known}")
