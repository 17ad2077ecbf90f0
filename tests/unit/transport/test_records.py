"""``transport.records.frozen``: a frozen, slotted dataclass whose ``__init__`` sets each slot directly. It
must build exactly what ``@dataclass(frozen=True, slots=True)`` builds: same parameters and defaults,
factories called per object, ``init=False`` fields, ``__post_init__``, the same errors."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from dataclasses import InitVar, dataclass, field
from typing import Any, ClassVar

import pytest

import actors
import transport
from actors.types import evolve
from transport.records import compiled_init, direct_setters, frozen


def _body(**extra: Any) -> dict[str, Any]:
    """One class body with every kind of field (the same one for both decorators)."""

    def post_init(self: Any) -> None:
        if self.count < 0:
            raise ValueError("count must not be negative")
        object.__setattr__(self, "derived", self.count * 2)

    return {
        "__annotations__": {
            "TAG": "ClassVar[str]",
            "name": "str",
            "count": "int",
            "tags": "tuple[str, ...]",
            "items": "list[int]",
            "mode": "str",
            "derived": "int",
            "made": "list[int]",
        },
        "TAG": "t.shape",
        "count": 0,
        "tags": (),
        "items": field(default_factory=list),
        "mode": field(default="plain", kw_only=True),
        "derived": field(default=0, init=False),
        "made": field(default_factory=lambda: [1], init=False),
        "__post_init__": post_init,
        **extra,
    }


Fast = frozen(type("Fast", (), _body()))
Stock = dataclass(frozen=True, slots=True)(type("Stock", (), _body()))


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(("a",), {}), (("a", 3, ("x",), [4]), {"mode": "loud"}), ((), {"name": "b", "count": 2})],
)
def test_frozen_builds_what_the_stock_dataclass_builds(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    fast, stock = Fast(*args, **kwargs), Stock(*args, **kwargs)
    assert _fields(fast) == _fields(stock)
    assert repr(fast).replace("Fast", "X") == repr(stock).replace("Stock", "X")
    assert fast == Fast(*args, **kwargs) and hash(fast.tags) == hash(stock.tags)


def test_frozen_calls_each_factory_per_object_and_runs_post_init() -> None:
    one, two = Fast("a"), Fast("a")
    assert one.items == [] and one.items is not two.items  # default_factory, per object
    assert one.made == [1] and one.made is not two.made  # an init=False field's factory too
    assert Fast("a", 5).derived == 10  # __post_init__ ran after every field was set
    with pytest.raises(ValueError, match="must not be negative"):
        Fast("a", -1)


def test_frozen_refuses_what_the_stock_dataclass_refuses() -> None:
    for cls in (Fast, Stock):
        with pytest.raises(TypeError):
            cls()  # a required field missing
        with pytest.raises(TypeError):
            cls("a", 1, (), [], "too many")  # mode is keyword-only
        with pytest.raises(TypeError):
            cls("a", derived=3)  # init=False: not a parameter
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls("a").count = 2  # type: ignore[misc]
    assert inspect.signature(Fast) == inspect.signature(Stock)


def test_a_class_whose_init_takes_an_initvar_keeps_the_generated_init() -> None:
    @frozen
    class Scaled:
        value: int
        scale: InitVar[int] = 1

        def __post_init__(self, scale: int) -> None:
            object.__setattr__(self, "value", self.value * scale)

    assert compiled_init(Scaled, Scaled.__init__.__wrapped__) is None  # type: ignore[misc]
    assert (Scaled(2).value, Scaled(2, 3).value, Scaled(2, 3).value) == (2, 6, 6)


def test_evolve_of_a_slotted_state_sets_its_slots() -> None:
    @frozen
    class State:
        a: int
        b: tuple[int, ...] = ()

    state = State(1, (2,))
    assert evolve(state, b=(3,)) == State(1, (3,)) == dataclasses.replace(state, b=(3,))
    assert evolve(state) == state and evolve(state) is not state


def _frozen_classes() -> list[type[Any]]:
    """Every class in actors and transport made with ``frozen``, nested ones (a union's members) too."""
    found: list[type[Any]] = []

    def walk(namespace: dict[str, Any], module: str) -> None:
        for value in list(namespace.values()):
            if isinstance(value, type) and value.__module__ == module and value not in found:
                if hasattr(value.__dict__.get("__init__"), "__wrapped__"):
                    found.append(value)
                walk(dict(vars(value)), module)

    for package in (actors, transport):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
            walk(dict(vars(module)), info.name)
    return found


def test_every_frozen_class_of_kbus_gets_an_init_with_the_generated_ones_parameters() -> None:
    classes = _frozen_classes()
    assert len(classes) > 300, len(classes)  # the walk found the codebase's messages and states
    for cls in classes:
        generated = cls.__dict__["__init__"].__wrapped__
        fast = compiled_init(cls, generated)
        assert fast is not None, f"{cls.__qualname__} falls back to the generated __init__"
        want = list(inspect.signature(generated).parameters.values())[1:]
        got = list(inspect.signature(fast, follow_wrapped=False).parameters.values())[1:]
        assert [(p.name, p.kind) for p in got] == [(p.name, p.kind) for p in want], cls.__qualname__
        for mine, theirs in zip(got, want, strict=True):
            if (
                theirs.default is inspect.Parameter.empty
                or type(theirs.default).__name__ == "_HAS_DEFAULT_FACTORY_CLASS"
            ):
                assert (mine.default is inspect.Parameter.empty) == (
                    theirs.default is inspect.Parameter.empty
                )
            else:
                assert mine.default is theirs.default, f"{cls.__qualname__}.{mine.name}"


def test_a_class_variable_is_not_a_parameter() -> None:
    @frozen(kw_only=True)
    class Message:
        TAG: ClassVar[str] = "t.message"
        text: str = ""

    assert Message(text="hi").text == "hi" and Message.TAG == "t.message"
    with pytest.raises(TypeError):
        Message(TAG="other")  # type: ignore[call-arg]


def test_repr_eq_and_hash_are_the_stock_dataclasses() -> None:
    fast, stock = Fast("a", 2, ("x",)), Stock("a", 2, ("x",))
    assert repr(fast) == repr(stock).replace("Stock", "Fast")
    assert fast == Fast("a", 2, ("x",)) and fast != Fast("a", 3, ("x",))
    assert fast.__eq__(stock) is NotImplemented  # another class is never equal (nor an error)
    for obj in (fast, stock):
        with pytest.raises(TypeError, match="unhashable type: 'list'"):
            hash(obj)  # its list fields are hashed, as the stock class hashes them


def test_a_classes_own_repr_eq_or_hash_is_kept_as_dataclass_keeps_it() -> None:
    def make(decorate: Any, **methods: Any) -> Any:
        body = {"__annotations__": {"a": "int", "b": "int"}, **methods}
        return decorate(type("Own", (), body))

    stock_dc = dataclass(frozen=True, slots=True)
    for methods in (
        {"__repr__": lambda self: "mine"},
        {
            "__eq__": lambda self, other: True
        },  # __eq__ alone: Python sets __hash__ = None; dataclass writes one
        {"__hash__": lambda self: 7},
        {"__eq__": lambda self, other: True, "__hash__": lambda self: 7},
    ):
        fast, stock = make(frozen, **methods)(1, 2), make(stock_dc, **methods)(1, 2)
        assert repr(fast).replace("Own", "X") == repr(stock).replace("Own", "X")
        assert (fast == make(frozen, **methods)(1, 3)) == (stock == make(stock_dc, **methods)(1, 3))
        assert hash(fast) == hash(stock), methods


def test_fields_left_out_of_repr_compare_or_hash_stay_out() -> None:
    def make(decorate: Any) -> Any:
        body = {
            "__annotations__": {"a": "int", "note": "str", "size": "int"},
            "note": field(default="", repr=False, compare=False),
            "size": field(default=0, hash=False),
        }
        return decorate(type("Parts", (), body))

    fast_cls, stock_cls = make(frozen), make(dataclass(frozen=True, slots=True))
    fast, stock = fast_cls(1, "n", 5), stock_cls(1, "n", 5)
    assert repr(fast) == repr(stock) == "Parts(a=1, size=5)"
    assert fast == fast_cls(1, "other", 5) and fast != fast_cls(1, "n", 6)
    assert hash(fast) == hash(stock) == hash(fast_cls(1, "n", 6))


def test_a_repr_that_reaches_its_own_object_says_so() -> None:
    @frozen
    class Box:
        items: list[Any]

    box = Box([])
    box.items.append(box)
    assert repr(box).endswith("Box(items=[...])")  # qualname: this function's local class


def test_direct_setters_only_where_building_is_setting_each_field() -> None:
    """``Registry.decode`` fills a new object through these setters itself: only for a class whose
    building from every field's value does nothing else."""

    @frozen
    class Plain:
        a: int
        b: str = ""

    @frozen
    class Checked:
        a: int

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError("a < 0")

    @frozen
    class Derived:
        a: int
        b: int = field(default=0, init=False)

    @frozen
    class OwnInit:
        a: int

        def __init__(self, a: int) -> None:
            object.__setattr__(self, "a", a * 2)

    @dataclass(frozen=True, slots=True)
    class Stock:
        a: int

    setters = direct_setters(Plain)
    assert setters is not None and len(setters) == 2
    made = object.__new__(Plain)
    for setter, value in zip(setters, (1, "x"), strict=True):
        setter(made, value)
    assert made == Plain(1, "x")
    assert [direct_setters(c) for c in (Checked, Derived, OwnInit, Stock)] == [None] * 4
    assert OwnInit(2).a == 4  # its own __init__ is kept
