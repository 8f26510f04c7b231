"""The family registry: families register themselves by name.

Every module of this package except `base` and the private ones (`_rows`: what the row-wise
families share; `_host_checks`: what the serving families check on the host; the engines)
defines one family and calls `register(...)` at its end; the registry imports
them all on first use, so a new built-in family is a new module here and nothing else. Other
packages add families through the `autosoft.families` entry-point group:

    [project.entry-points."autosoft.families"]
    myfamily = "mypackage.myfamily:MY_FAMILY"     # a Family instance (or a Family subclass)

A plug-in that fails to load is skipped with a warning naming it; it never breaks autosoft.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import threading
import warnings
from importlib.metadata import entry_points

from ..errors import UserError
from .base import Family

ENTRY_POINT_GROUP = "autosoft.families"

_registry: dict[str, Family] = {}  # the one registry: filled once, then only read
_lock = threading.Lock()
_built_in = False   # the modules of this package imported
_plugged_in = False  # the entry points loaded


def register(family: Family) -> Family:
    """Add a family under its name (returned, so a module can write FAMILY = register(MyFamily())).
    Registering a second, different family under a taken name raises ValueError."""
    if not isinstance(family, Family):
        raise TypeError(f"{family!r} is not an autosoft.families.base.Family instance")
    existing = _registry.get(family.name)
    if existing is not None and existing is not family and type(existing) is not type(family):
        raise ValueError(f"two families are named {family.name!r}: {type(existing).__module__} "
                         f"and {type(family).__module__}")
    _registry.setdefault(family.name, family)
    return _registry[family.name]


def _discover(plug_ins: bool = True) -> None:
    """Import the built-in family modules, and with plug_ins load the entry points, once each.
    Entry points are read only when they can matter (listing every family, or a name that no
    built-in family has): reading every installed distribution's metadata costs a first call
    tens of milliseconds."""
    global _built_in, _plugged_in
    if _built_in and (_plugged_in or not plug_ins):
        return
    with _lock:
        if not _built_in:
            for module in pkgutil.iter_modules(__path__):
                if module.name != "base" and not module.name.startswith("_"):
                    importlib.import_module(f"{__name__}.{module.name}")
            _built_in = True
        if plug_ins and not _plugged_in:
            for point in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    loaded = point.load()
                    register(loaded() if isinstance(loaded, type) else loaded)
                except Exception as exc:  # noqa: BLE001 - a broken plug-in must not break autosoft
                    warnings.warn(f"autosoft: family plug-in {point.name!r} ({point.value}) was not loaded: "
                                  f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)
            _plugged_in = True


def families() -> dict[str, Family]:
    """Every registered family by name, sorted."""
    _discover()
    return dict(sorted(_registry.items()))


def get_family(name: str) -> Family:
    """The family registered as `name`; UserError listing the known ones otherwise. A built-in
    family lives in the module of its name: that module alone is imported for it (a first call
    does not pay for the others)."""
    if name not in _registry and not _built_in and name.isidentifier() and not name.startswith("_") \
            and name != "base" and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        importlib.import_module(f"{__name__}.{name}")
    if name not in _registry:
        _discover(plug_ins=False)
    if name not in _registry:
        _discover()
    try:
        return _registry[name]
    except KeyError:
        raise UserError(f"unknown family {name!r}: choose one of {', '.join(sorted(_registry))}") from None


__all__ = ["ENTRY_POINT_GROUP", "Family", "families", "get_family", "register"]
