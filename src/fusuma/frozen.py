"""``@frozen``: ``@dataclass(frozen=True)`` for fusuma's many small value classes, at
about half its import-time cost.

Every fusuma command, supervisor and agent is a new Python process, and each defines
100-150 frozen dataclasses as it imports fusuma. For each class, ``dataclass`` (Python
3.11) writes and compiles a ``__repr__``, an ``__eq__`` and a ``__hash__`` of its own:
about half of the ~1.2 ms a class costs, and a ``fusuma`` command spends 40-50% of its
import time in ``dataclass``. ``@frozen`` has ``dataclass`` make the rest (``__init__``,
the frozen ``__setattr__`` and ``__delattr__``, the fields, ``__match_args__``) and gives
every class the same three methods, which read the class's fields (once per class):
the same repr text, the same equality (an instance of the same class with equal
compared fields) and the same hash (of the compared fields, or of those a field's
``hash`` names) as the generated ones. ``dataclasses.fields``, ``replace`` and ``asdict``
work as on any dataclass; a type checker sees a frozen dataclass (``dataclass_transform``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_: Any) -> Any:     # typing's needs no import at run time
        return lambda f: f

T = TypeVar("T")

# Per class: the names its repr shows, its equality compares, its hash covers.
_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}


def _names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    got = _NAMES.get(cls)
    if got is None:
        fs = fields(cls)
        got = _NAMES[cls] = (
            tuple(f.name for f in fs if f.repr),
            tuple(f.name for f in fs if f.compare),
            tuple(f.name for f in fs if (f.compare if f.hash is None else f.hash)))
    return got


def _repr(self: Any) -> str:
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in _names(type(self))[0])
    return f"{type(self).__qualname__}({shown})"


def _eq(self: Any, other: object) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    names = _names(type(self))[1]
    return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)


def _hash(self: Any) -> int:
    return hash(tuple(getattr(self, n) for n in _names(type(self))[2]))


@dataclass_transform(frozen_default=True)
def frozen(cls: type[T]) -> type[T]:
    """``@dataclass(frozen=True)``, with the shared ``__repr__``, ``__eq__`` and
    ``__hash__`` above (a class that defines one of them keeps its own)."""
    out = dataclass(frozen=True, repr=False, eq=False)(cls)
    for name, fn in (("__repr__", _repr), ("__eq__", _eq), ("__hash__", _hash)):
        if name not in cls.__dict__:
            setattr(out, name, fn)
    return out
