""":mod:`dataclasses` internals that ``extproc.quick_init`` reads (CPython 3.11 to 3.13).

``quick_init`` writes a frozen dataclass's ``__init__`` itself, so it needs two things the
module does not export: the sentinel a ``default_factory`` parameter shows in the signature,
and how to tell an ``InitVar`` pseudo-field (which ``dataclasses.fields`` leaves out).
"""

from __future__ import annotations

import dataclasses
from typing import Any

try:
    DEFAULT_FACTORY: Any = dataclasses._HAS_DEFAULT_FACTORY  # type: ignore[attr-defined]
    """Stands for "not given" in the parameter list of a field with a ``default_factory``."""
    _INITVAR: Any = dataclasses._FIELD_INITVAR  # type: ignore[attr-defined]
except AttributeError as exc:  # pragma: no cover - only on a Python that changed them
    raise ImportError(f"dataclasses no longer has {exc.name}: extproc.quick_init needs "
                      "CPython 3.11-3.13's internals (pyproject.toml: requires-python)") from exc


def has_initvar(cls: type) -> bool:
    """Does the dataclass ``cls`` declare an ``InitVar`` field?"""
    fields: dict[str, Any] = cls.__dataclass_fields__  # type: ignore[attr-defined]
    return any(f._field_type is _INITVAR for f in fields.values())
