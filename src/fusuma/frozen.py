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
``hash`` names) as the generated ones. The frozen ``__setattr__`` and ``__delattr__``
(Python 3.11, 3.12: two more functions compiled per class) are closures over the same
code, lent to ``dataclass`` for the call, and a class without a docstring gets
dataclass's (its signature) when it is first read: ``rpc``'s 50 classes import in
half the time. ``dataclasses.fields``, ``replace`` and ``asdict``
work as on any dataclass; a type checker sees a frozen dataclass (``dataclass_transform``).
"""

from __future__ import annotations

import dataclasses
import marshal
import sys
import typing
from collections.abc import Callable
from dataclasses import FrozenInstanceError, dataclass, fields
from pathlib import Path
from types import CodeType
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


def _frozen_get_del_attr(cls: type, fs: list[dataclasses.Field[Any]],
                         globals: dict[str, Any]) -> tuple[Callable[..., None], ...]:
    """dataclasses' frozen ``__setattr__`` and ``__delattr__`` for ``cls``, the same code
    (refuse a field, or any name on ``cls`` itself; defer to the base otherwise) as
    closures instead of two functions written and compiled per class."""
    names = tuple(f.name for f in fs)
    owner: Any = cls

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is owner or name in names:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        super(owner, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is owner or name in names:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        super(owner, self).__delattr__(name)

    __setattr__.__module__ = __delattr__.__module__ = cls.__module__
    return __setattr__, __delattr__


# Python 3.11 and 3.12 compile both per class through this hook (3.13 compiles all of a
# class's methods at once); elsewhere dataclass's own run.
_STD_FROZEN_ATTRS = (getattr(dataclasses, "_frozen_get_del_attr", None)
                     if sys.version_info[:2] in ((3, 11), (3, 12)) else None)


# Python 3.11: each class's ``__init__`` is still the text dataclass writes, but compiled
# once: ``make bytecode`` stores the code of every fusuma class's (``python -m
# fusuma.frozen``) beside fusuma's bytecode, a file per module, and a text found there
# is not compiled again (any other, e.g. from another dataclasses, is compiled as before).
INIT_CACHE = (Path(__file__).parent / "__pycache__"
              / f"frozen-inits.{sys.implementation.cache_tag}")
# By module: the codes its file holds (read at its first class), those compiled here.
_CODES: dict[str, dict[str, CodeType]] = {}
_COMPILED: dict[str, dict[str, CodeType]] = {}
_STD_CREATE_FN = (getattr(dataclasses, "_create_fn", None)
                  if sys.version_info[:2] == (3, 11) else None)


def _codes(module: str) -> dict[str, CodeType]:
    got: Any = _CODES.get(module)
    if got is None:
        try:
            got = marshal.loads((INIT_CACHE / f"{module}.marshal").read_bytes())
        except (OSError, ValueError, EOFError, TypeError):
            got = {}
        if not (isinstance(got, dict) and all(
                isinstance(k, str) and isinstance(v, CodeType) for k, v in got.items())):
            got = {}
        _CODES[module] = got
    return typing.cast(dict[str, CodeType], got)


def _create_fn(name: str, args: list[str], body: list[str], *,
               globals: dict[str, Any] | None = None, locals: dict[str, Any] | None = None,
               return_type: Any = dataclasses.MISSING) -> Any:
    """dataclasses._create_fn of Python 3.11, line for line, but the text's code is
    looked up before it is compiled."""
    if locals is None:
        locals = {}
    return_annotation = ""
    if return_type is not dataclasses.MISSING:
        locals["_return_type"] = return_type
        return_annotation = "->_return_type"
    arglist = ",".join(args)
    lines = "\n".join(f"  {b}" for b in body)
    txt = f" def {name}({arglist}){return_annotation}:\n{lines}"
    local_vars = ", ".join(locals.keys())
    txt = f"def __create_fn__({local_vars}):\n{txt}\n return {name}"
    module = str((globals or {}).get("__name__", ""))
    mine = _COMPILED.setdefault(module, {})
    code = _codes(module).get(txt) or mine.get(txt)
    if code is None:
        # As exec(txt) in dataclasses: no __future__ flag of this module's.
        code = mine[txt] = compile(txt, "<string>", "exec", dont_inherit=True)
    ns: dict[str, Any] = {}
    exec(code, globals, ns)
    return ns["__create_fn__"](**locals)


def write_init_cache() -> int:
    """Import every fusuma module and store the ``__init__`` code of each ``@frozen``
    class (INIT_CACHE, for ``make bytecode``); returns how many."""
    import importlib
    import pkgutil

    import fusuma

    for mod in pkgutil.walk_packages(fusuma.__path__, "fusuma."):
        if not mod.name.endswith("__main__"):
            importlib.import_module(mod.name)
    INIT_CACHE.mkdir(parents=True, exist_ok=True)
    for old in INIT_CACHE.glob("*.marshal"):
        old.unlink()
    count = 0
    for module, codes in _COMPILED.items():
        codes = {**_codes(module), **codes}
        if module.startswith("fusuma") and codes:
            tmp = INIT_CACHE / f".{module}.tmp"
            tmp.write_bytes(marshal.dumps(codes))
            tmp.replace(INIT_CACHE / f"{module}.marshal")
            count += len(codes)
    return count


class _Doc:
    """The docstring ``dataclass`` gives a class without one (its name and signature:
    ``Pong(pid: 'int', ...)``), made when first read instead of by ``inspect.signature``
    for each class at import."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __get__(self, obj: object, owner: type | None = None) -> str:
        import inspect

        cls = self.cls
        try:
            text_sig = str(inspect.signature(cls)).replace(" -> None", "")
        except (TypeError, ValueError):
            text_sig = ""
        doc = cls.__doc__ = cls.__name__ + text_sig
        return doc


@dataclass_transform(frozen_default=True)
def frozen(cls: type[T]) -> type[T]:
    """``@dataclass(frozen=True)``, with the shared ``__repr__``, ``__eq__`` and
    ``__hash__`` above (a class that defines one of them keeps its own)."""
    undocumented = not cls.__doc__
    if undocumented:
        cls.__doc__ = "(made when read)"       # so that dataclass does not make it
    if _STD_FROZEN_ATTRS is None:
        out = dataclass(frozen=True, repr=False, eq=False)(cls)
    else:
        dataclasses._frozen_get_del_attr = _frozen_get_del_attr   # type: ignore[attr-defined]
        if _STD_CREATE_FN is not None:
            dataclasses._create_fn = _create_fn                   # type: ignore[attr-defined]
        try:
            out = dataclass(frozen=True, repr=False, eq=False)(cls)
        finally:
            dataclasses._frozen_get_del_attr = _STD_FROZEN_ATTRS  # type: ignore[attr-defined]
            if _STD_CREATE_FN is not None:
                dataclasses._create_fn = _STD_CREATE_FN           # type: ignore[attr-defined]
    if undocumented:
        out.__doc__ = _Doc(out)                 # type: ignore[assignment]
    for name, fn in (("__repr__", _repr), ("__eq__", _eq), ("__hash__", _hash)):
        if name not in cls.__dict__:
            setattr(out, name, fn)
    return out


if __name__ == "__main__":     # the classes use the module fusuma.frozen, not this copy
    from fusuma import frozen as _module

    print(f"{_module.write_init_cache()} __init__ codes in {_module.INIT_CACHE}")
