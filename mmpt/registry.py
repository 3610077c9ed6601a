"""The one way mmpt keeps many things of a kind by name: methods, demo corpora, model presets.

A built-in entry is named with the module that registers it, and that module is imported on first lookup,
so a method's dependencies load only when a config names it. Anything else registers when its own module is
imported (`launch/train.py --import my_package.my_method`).
"""

from __future__ import annotations

import difflib
import importlib
import types
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class NotRegistered(LookupError):
    """A name no entry is registered under; the message names the closest one and lists the rest."""


def _origin(entry: Any) -> str | None:
    """Where an entry was defined (a function's or class's own name, an instance's class), or None for plain
    data. Registering the same definition again (a module imported twice) is not a conflict."""
    if isinstance(entry, (type, types.FunctionType)):
        return f"{entry.__module__}.{entry.__qualname__}"
    if isinstance(entry, (dict, list, tuple, str, int, float)):
        return None
    return f"{type(entry).__module__}.{type(entry).__qualname__}"


def _module_of(entry: Any) -> str:
    owner = entry if isinstance(entry, (type, types.FunctionType)) else type(entry)
    return owner.__module__


class Registry(Generic[T]):
    def __init__(self, kind: str, builtin: dict[str, str] | None = None):
        self.kind = kind
        self.builtin = dict(builtin or {})  # name -> module that registers it
        self._entries: dict[str, T] = {}

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, entry: T) -> T: ...

    def register(self, name: str, entry: Any = None) -> Any:
        """`register(name, entry)` returns the entry; `@register(name)` decorates a function or class."""
        if entry is None:
            return lambda decorated: self.register(name, decorated)
        if name in self.builtin and _module_of(entry) != self.builtin[name]:
            raise ValueError(
                f"{self.kind} {name!r} is built in ({self.builtin[name]}); register yours under another name"
            )
        known = self._entries.get(name)
        if (
            known is not None
            and known is not entry
            and (_origin(known) is None or _origin(known) != _origin(entry))
            and known != entry
        ):
            raise ValueError(f"a {self.kind} named {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted({*self.builtin, *self._entries})

    def __contains__(self, name: object) -> bool:
        return name in self.builtin or name in self._entries

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def get(self, name: str) -> T:
        if name not in self._entries and name in self.builtin:
            importlib.import_module(self.builtin[name])
        if name not in self._entries:
            close = difflib.get_close_matches(str(name), self.names(), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise NotRegistered(f"{name!r} is not a known {self.kind}{hint}; known: {', '.join(self.names())}")
        return self._entries[name]
