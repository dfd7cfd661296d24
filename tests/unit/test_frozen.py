"""``@frozen`` behaves as ``@dataclass(frozen=True)``: the same repr, equality, hash,
fields, replace and refusal to change, class by class, side by side."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

import fusuma.frozen
from fusuma.frozen import frozen


def pair(body: dict[str, Any], base: tuple[type, type] | None = None) -> tuple[type, type]:
    """The class ``body`` made twice: by ``@dataclass(frozen=True)`` and by ``@frozen``
    (each on its own base of ``base``, if given)."""
    def make(deco: Any, bases: tuple[type, ...]) -> type:
        return deco(type("Thing", bases, dict(body)))
    std_base, ours_base = base or (object, object)
    return make(dataclass(frozen=True), (std_base,)), make(frozen, (ours_base,))


BODIES = [
    {"__annotations__": {"a": "str", "b": "int"}},
    {"__annotations__": {"a": "str", "b": "list[int] | None"}, "b": None},
    {"__annotations__": {"a": "str", "slot": "int", "note": "str"},
     "slot": field(default=0, compare=False), "note": field(default="", repr=False)},
    {"__annotations__": {"a": "str", "h": "int"}, "h": field(default=1, hash=False)},
    {"__annotations__": {}},
]
VALUES = [
    [("x", 1), ("x", 2), ("y", 1)],
    [("x",), ("x", [1, 2]), ("y", None)],
    [("x", 1, "n"), ("x", 2, "n"), ("x", 1, "m"), ("y", 1, "n")],
    [("x", 1), ("x", 2), ("y", 1)],
    [(), (), ()],
]


@pytest.mark.parametrize(("body", "values"), list(zip(BODIES, VALUES, strict=True)))
def test_same_behaviour_as_a_frozen_dataclass(body: dict[str, Any],
                                              values: list[tuple[Any, ...]]) -> None:
    std, ours = pair(body)
    for args in values:
        s, o = std(*args), ours(*args)
        assert repr(s) == repr(o)
        assert [f.name for f in dataclasses.fields(s)] == [f.name for f in dataclasses.fields(o)]
        assert dataclasses.asdict(s) == dataclasses.asdict(o)
        assert std.__match_args__ == ours.__match_args__
        for obj in (s, o):
            with pytest.raises(dataclasses.FrozenInstanceError,
                               match=r"^cannot assign to field 'a'$"):
                obj.a = "changed"                 # type: ignore[attr-defined]
            with pytest.raises(dataclasses.FrozenInstanceError,
                               match=r"^cannot delete field 'a'$"):
                del obj.a                         # type: ignore[attr-defined]
            with pytest.raises(dataclasses.FrozenInstanceError,
                               match=r"^cannot assign to field 'other'$"):
                obj.other = 1                     # type: ignore[attr-defined]
        try:
            want: object = hash(s)
        except TypeError as exc:
            want = type(exc)
        try:
            got: object = hash(o)
        except TypeError as exc:
            got = type(exc)
        assert got == want, args
    for a in values:
        for b in values:
            assert (std(*a) == std(*b)) == (ours(*a) == ours(*b)), (a, b)
            assert (std(*a) != std(*b)) == (ours(*a) != ours(*b)), (a, b)
    if values[0]:
        changed = dataclasses.replace(ours(*values[0]), a="z")
        assert type(changed) is ours and changed.a == "z"
    # Another class with the same fields is never equal (as a dataclass's __eq__).
    other = frozen(type("Other", (), dict(body)))
    assert ours(*values[0]) != other(*values[0])
    assert std(*values[0]) != dataclass(frozen=True)(type("Other", (), dict(body)))(*values[0])


def test_a_subclass_compares_and_shows_its_own_fields() -> None:
    std_base, ours_base = pair({"__annotations__": {"a": "str"}})
    std, ours = pair({"__annotations__": {"b": "int"}}, base=(std_base, ours_base))
    assert repr(std("x", 1)) == repr(ours("x", 1)) == "Thing(a='x', b=1)"
    assert ours("x", 1) == ours("x", 1) and ours("x", 1) != ours("x", 2)
    assert ours("x", 1) != ours_base("x") and hash(ours("x", 1)) == hash(std("x", 1))


def test_the_same_docstring() -> None:
    """Made when read, the text dataclass would have made; a class's own stays."""
    for body in BODIES:
        std, ours = pair(body)
        assert ours.__doc__ == std.__doc__ and ours.__doc__.startswith("Thing(")
        assert ours(*VALUES[BODIES.index(body)][0]).__doc__ == std.__doc__
    std, ours = pair({"__annotations__": {"a": "str"}, "__doc__": "Its own."})
    assert std.__doc__ == ours.__doc__ == "Its own."


def test_a_plain_subclass_may_set_its_own_attributes() -> None:
    """As with dataclass: only the fields stay frozen in a subclass that is not a
    dataclass itself."""
    std_base, ours_base = pair({"__annotations__": {"a": "str"}})
    for base in (std_base, ours_base):
        sub = type("Sub", (base,), {})
        obj = sub("x")
        obj.extra = 1
        del obj.extra
        with pytest.raises(dataclasses.FrozenInstanceError, match="'a'"):
            obj.a = "y"
        with pytest.raises(dataclasses.FrozenInstanceError, match="'a'"):
            del obj.a


def test_the_standard_dataclass_is_left_alone() -> None:
    """``@frozen`` lends dataclasses its own frozen methods only for its own call."""
    @frozen
    class Ours:
        a: str

    @dataclass(frozen=True)
    class Std:
        a: str

    assert Std.__setattr__.__code__.co_filename == "<string>"
    if fusuma.frozen._STD_FROZEN_ATTRS is not None:      # Python 3.11, 3.12
        assert Ours.__setattr__.__code__.co_filename != "<string>"
    assert Ours.__setattr__.__qualname__ == Std.__setattr__.__qualname__.replace("Std", "Ours")
    assert Ours.__setattr__.__module__ == Std.__setattr__.__module__ == __name__


def test_a_class_keeps_its_own_methods() -> None:
    @frozen
    class Named:
        name: str

        def __repr__(self) -> str:
            return f"<{self.name}>"

    assert repr(Named("a")) == "<a>" and Named("a") == Named("a")


def test_an_init_from_the_cache_is_the_one_dataclass_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A class whose ``__init__`` text is in the cache (``make bytecode``) is not
    compiled again, and gets the same ``__init__``: signature, defaults, factories."""
    if fusuma.frozen._STD_CREATE_FN is None:
        pytest.skip("the cache is for Python 3.11's dataclasses")
    body = {"__annotations__": {"a": "str", "b": "list[int]", "c": "int"},
            "b": field(default_factory=list), "c": 3}
    monkeypatch.setattr(fusuma.frozen, "_CODES", {__name__: {}})
    monkeypatch.setattr(fusuma.frozen, "_COMPILED", {})
    std, _ = pair(body)
    compiled = fusuma.frozen._COMPILED
    assert list(compiled) == [__name__] and len(compiled[__name__]) == 1   # compiled once
    monkeypatch.setattr(fusuma.frozen, "_CODES", compiled)
    monkeypatch.setattr(fusuma.frozen, "_COMPILED", {})
    ours = frozen(type("Thing", (), dict(body)))
    assert {__name__: {}} == fusuma.frozen._COMPILED    # found, not compiled
    import inspect

    assert inspect.signature(ours) == inspect.signature(std)
    assert ours.__init__.__annotations__ == std.__init__.__annotations__  # type: ignore[misc]
    assert repr(ours("x")) == repr(std("x")) == "Thing(a='x', b=[], c=3)"
    assert ours("x").b is not ours("x").b
