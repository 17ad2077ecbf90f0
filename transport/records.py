"""``frozen``: the frozen, slotted dataclass every message and state is, built at a plain class's speed.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__(self, name,
value)`` (its own ``__setattr__`` refuses), which looks the slot up by name on every call: a message of six
fields costs twice what it would with plain assignments. A round of the agent loop builds about sixty such
objects (messages, replies, machine states), and a decoded tell one each. ``frozen`` makes the class with
``dataclasses.dataclass(frozen=True, slots=True)`` and then gives it an ``__init__`` that calls each
slot's own setter (its member descriptor's ``__set__``) directly: the same parameters, defaults,
``default_factory`` calls, ``init=False`` fields and ``__post_init__`` call, in the same order.

That ``__init__`` is compiled when the class is first built, not at import; until then the class's
``__init__`` is a stand-in that compiles, installs and calls the fast one, and ``inspect.signature`` sees
the dataclass's own (``__wrapped__``). ``__repr__``, ``__eq__`` and ``__hash__`` are compiled the same way,
when first called: dataclass's own, field by field, and left to the class where it writes its own, by
dataclass's rules. (``dataclasses`` compiles six methods for each class as it is made; a process imports
some four hundred classes and never prints, compares or even builds most of them: this cut kbus's import
by about a fifth here. The classes' ``__dataclass_params__`` say ``repr=False, eq=False``; the methods are
there all the same.) A class the fast ``__init__`` cannot serve (a field that is not a slot, an
``InitVar``) keeps the generated one, and so does a class that writes its own ``__init__`` (dataclass
keeps it too). ``direct_setters(cls)`` gives the same setters to ``Registry.decode`` and
``actors.types.evolve``, for the classes whose building is only the setting of every field.
"""

from __future__ import annotations

import dataclasses
import inspect
import reprlib
import types
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform, overload

_T = TypeVar("_T")
_Setter = Callable[[Any, Any], None]
_SETTERS: dict[type[Any], tuple[_Setter, ...] | None] = {}
_FACTORY = object()  # a default_factory field's parameter default: "not given, call the factory"
_MADE: set[type[Any]] = set()  # classes ``frozen`` made that do not write their own __init__


@overload
def frozen(cls: type[_T], /) -> type[_T]: ...


@overload
def frozen(*, kw_only: bool = False) -> Callable[[type[_T]], type[_T]]: ...


@dataclass_transform(frozen_default=True)
def frozen(cls: type[_T] | None = None, /, *, kw_only: bool = False) -> Any:
    """``@dataclass(frozen=True, slots=True, kw_only=kw_only)``, with a faster ``__init__`` and its
    ``__repr__``, ``__eq__`` and ``__hash__`` compiled on first use (see the module docstring)."""

    def wrap(cls: type[_T]) -> type[_T]:
        own = cls.__dict__
        # What dataclass would leave to the class (its own __repr__, __eq__, an explicit __hash__: a class
        # that writes __eq__ alone has __hash__ = None put in by Python, which is not explicit).
        keep_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
        own_init = "__init__" in own  # read first: dataclass writes one into the class it is given
        made: type[_T] = dataclasses.dataclass(
            frozen=True, slots=True, kw_only=kw_only, repr=False, eq=False
        )(cls)
        if not own_init:  # dataclass keeps a class's own __init__, and so does frozen
            _MADE.add(made)
            generated = made.__dict__["__init__"]
            _later(made, "__init__", lambda: compiled_init(made, generated) or generated, wrapped=generated)
        if "__repr__" not in own:
            _later(made, "__repr__", _compiled(made, "__repr__", _repr_source))
        if "__eq__" not in own:
            _later(made, "__eq__", _compiled(made, "__eq__", _eq_source))
        if not keep_hash:
            _later(made, "__hash__", _compiled(made, "__hash__", _hash_source))
        return made

    return wrap if cls is None else wrap(cls)


def setters(cls: type[Any]) -> tuple[_Setter, ...] | None:
    """The slot setters of ``cls``'s dataclass fields, in field order; None when one is not a slot."""
    if cls in _SETTERS:
        return _SETTERS[cls]
    out: list[_Setter] = []
    for field in dataclasses.fields(cls):
        for klass in cls.__mro__:
            slot = klass.__dict__.get(field.name)
            if slot is not None:
                if type(slot) is not types.MemberDescriptorType:
                    _SETTERS[cls] = None
                    return None
                out.append(slot.__set__)
                break
        else:
            _SETTERS[cls] = None
            return None
    _SETTERS[cls] = result = tuple(out)
    return result


def direct_setters(cls: type[Any]) -> tuple[_Setter, ...] | None:
    """The slot setters of ``cls``'s fields when building it from a value for every field is only setting
    each one (``Registry.decode`` then fills a new object itself): a class ``frozen`` made, that writes no
    ``__init__`` of its own, has no ``__post_init__`` and no ``init=False`` field. Else None."""
    if cls not in _MADE or hasattr(cls, "__post_init__"):
        return None
    if not all(field.init for field in dataclasses.fields(cls)):
        return None
    return setters(cls)


def compiled_init(cls: type[Any], generated: Callable[..., None]) -> Callable[..., None] | None:
    """The fast ``__init__`` for dataclass ``cls`` (compiled now), or None when ``cls`` needs its own
    ``generated`` one: a field is not a slot, or the generated one takes what is not a field (an
    ``InitVar``)."""
    slot_setters = setters(cls)
    fields = dataclasses.fields(cls)
    taken = list(inspect.signature(generated).parameters)[1:]
    if slot_setters is None or sorted(taken) != sorted(f.name for f in fields if f.init):
        return None
    scope: dict[str, Any] = {"_factory_": _FACTORY}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for i, (field, setter) in enumerate(zip(fields, slot_setters, strict=True)):
        scope[f"_set{i}_"] = setter
        has_default = field.default is not dataclasses.MISSING
        has_factory = field.default_factory is not dataclasses.MISSING
        if has_default:
            scope[f"_default{i}_"] = field.default
        if has_factory:
            scope[f"_make{i}_"] = field.default_factory
        if not field.init:
            if has_default:
                body.append(f"    _set{i}_(_self_, _default{i}_)")
            elif has_factory:
                body.append(f"    _set{i}_(_self_, _make{i}_())")
            continue
        name = field.name
        if has_default:
            param = f"{name}=_default{i}_"
            value = name
        elif has_factory:
            param = f"{name}=_factory_"
            value = f"_make{i}_() if {name} is _factory_ else {name}"
        else:
            param, value = name, name
        (keyword if field.kw_only else positional).append(param)
        body.append(f"    _set{i}_(_self_, {value})")
    if hasattr(cls, "__post_init__"):
        body.append("    _self_.__post_init__()")
    params = ", ".join(["_self_", *positional, *(["*", *keyword] if keyword else [])])
    source = "\n".join([f"def __init__({params}):", *(body or ["    pass"])])
    exec(source, scope)  # the source is made of the class's own field names only
    init: Callable[..., None] = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__wrapped__ = generated  # type: ignore[attr-defined]  # its signature, for inspect
    return init


def _fields_of(obj: str, fields: list[dataclasses.Field[Any]]) -> str:
    """The source of the tuple of ``fields`` read off the variable ``obj``: ``(obj.a,obj.b,)``."""
    return f"({''.join(f'{obj}.{f.name},' for f in fields)})"


def _repr_source(cls: type[Any]) -> str:
    shown = ", ".join(f"{f.name}={{_self_.{f.name}!r}}" for f in dataclasses.fields(cls) if f.repr)
    return f"def __repr__(_self_):\n    return _self_.__class__.__qualname__ + f'({shown})'"


def _eq_source(cls: type[Any]) -> str:
    compared = [f for f in dataclasses.fields(cls) if f.compare]
    return "\n".join(
        [
            "def __eq__(_self_, _other_):",
            "    if _other_.__class__ is _self_.__class__:",
            f"        return {_fields_of('_self_', compared)} == {_fields_of('_other_', compared)}",
            "    return NotImplemented",
        ]
    )


def _hash_source(cls: type[Any]) -> str:
    hashed = [f for f in dataclasses.fields(cls) if (f.compare if f.hash is None else f.hash)]
    return f"def __hash__(_self_):\n    return hash({_fields_of('_self_', hashed)})"


def _compiled(cls: type[Any], name: str, source_of: Callable[[type[Any]], str]) -> Callable[[], Any]:
    """The maker of the ``name`` method dataclass would write for ``cls`` (``repr=True``, ``eq=True`` and,
    frozen, the fields' hash), from dataclass's own source, field by field."""

    def make() -> Callable[..., Any]:
        scope: dict[str, Any] = {}
        exec(source_of(cls), scope)  # the source is made of the class's own field names only
        method: Callable[..., Any] = scope[name]
        if name == "__repr__":
            method = reprlib.recursive_repr()(method)  # a field that holds the object itself: "..."
        method.__qualname__ = f"{cls.__qualname__}.{name}"
        return method

    return make


def _later(cls: type[Any], name: str, make: Callable[[], Callable[..., Any]], wrapped: Any = None) -> None:
    """Give ``cls`` a stand-in ``name`` method that, on its first call, makes the real one, installs it on
    ``cls`` (later calls go straight to it) and calls it. ``wrapped``: what ``inspect.signature`` reads."""

    def stand_in(self: Any, *args: Any, **kwargs: Any) -> Any:
        method = make()
        setattr(cls, name, method)
        return method(self, *args, **kwargs)

    stand_in.__qualname__ = f"{cls.__qualname__}.{name}"
    if wrapped is not None:
        stand_in.__wrapped__ = wrapped  # type: ignore[attr-defined]
    setattr(cls, name, stand_in)
