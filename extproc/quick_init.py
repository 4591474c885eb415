"""A frozen dataclass's ``__init__`` without its per-field ``object.__setattr__`` (issue 16).

A frozen dataclass refuses ``setattr``, so the ``__init__`` :mod:`dataclasses` writes for it
calls ``object.__setattr__`` once per field: ~0.12 µs a field, 2.2 µs for a request's record
of 18 fields, and extproc builds about fifteen such values per request (answers, records,
the request's context and decisions). :func:`quick_init` swaps in an ``__init__`` with the very
same signature that stores the fields into the instance's ``__dict__`` directly (what
``object.__setattr__`` ends up doing for a plain attribute), a third of the cost; everything
else (frozen ``setattr``, ``__eq__``, ``__hash__``, ``__repr__``, ``__post_init__``,
``dataclasses.replace``) is the dataclass's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from sidecar_runtime.compat.dataclass_internals import DEFAULT_FACTORY, has_initvar

_T = TypeVar("_T")


def quick_init(cls: type[_T]) -> type[_T]:
    """``cls`` (a frozen dataclass without slots, no ``InitVar``, no keyword-only fields)
    with the faster ``__init__``; anything else is refused at import time."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.init or "__slots__" in cls.__dict__:
        raise TypeError(f"quick_init takes a frozen dataclass without slots, not {cls}")
    if has_initvar(cls):
        raise TypeError(f"quick_init does not handle InitVar fields ({cls})")
    names: dict[str, Any] = {"__quick_factory": DEFAULT_FACTORY}
    args: list[str] = []
    body: list[str] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.kw_only:
            raise TypeError(f"quick_init does not handle keyword-only fields ({cls})")
        if f.name.startswith("__quick_") or f.name == "self":
            raise TypeError(f"{cls}.{f.name}: a name quick_init's own code uses")
        factory = f"__quick_factory_{f.name}"
        if f.default_factory is not dataclasses.MISSING:
            names[factory] = f.default_factory
        if not f.init:
            # As dataclasses does: a plain default stays a class attribute, a factory's runs.
            if f.default_factory is not dataclasses.MISSING:
                body.append(f"__quick_dict[{f.name!r}] = {factory}()")
            continue
        if f.default is not dataclasses.MISSING:
            names[f"__quick_default_{f.name}"] = f.default
            args.append(f"{f.name}=__quick_default_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            args.append(f"{f.name}=__quick_factory")
            body.append(f"if {f.name} is __quick_factory: {f.name} = {factory}()")
        else:
            args.append(f.name)
        body.append(f"__quick_dict[{f.name!r}] = {f.name}")
    if hasattr(cls, "__post_init__"):
        body.append("self.__post_init__()")
    lines = "\n".join(f"    {line}" for line in ["__quick_dict = self.__dict__", *body])
    source = f"def __init__(self, {', '.join(args)}):\n{lines}\n"
    exec(source, names)  # the source is made above from the class's own field names
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
