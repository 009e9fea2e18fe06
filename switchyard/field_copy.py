"""One record as another that mirrors it: a message from the domain record it carries, or a
dataclass from the message it arrived in.

Where a message declares the same fields as a record (a cost row, a device, a rank's
report), a converter that lists each field twice only repeats the message. `copy_fields`
takes every field of the target from the source's attribute of the same name; the fields
that differ (another name, a unit, a default for None) are given by the caller. A field the
source lacks and the caller does not give raises AttributeError: a renamed field fails the
first call, it is never silently left empty.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def field_names(cls: type[Any]) -> list[str]:
    """The fields of a protobuf message class or a dataclass, in declaration order."""
    descriptor = getattr(cls, "DESCRIPTOR", None)
    if descriptor is not None:
        return [f.name for f in descriptor.fields]
    return [f.name for f in dataclasses.fields(cls) if f.init]


def copy_fields(cls: type[T], source: object, **given: Any) -> T:
    """`cls` with each field from `given`, else from `source`'s attribute of that name."""
    names = field_names(cls)
    unknown = set(given) - set(names)
    if unknown:  # before reading the source: a misspelt given name is named as such
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    return cls(**{name: given[name] if name in given else getattr(source, name) for name in names})
