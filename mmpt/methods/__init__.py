"""Method registry: a method plugs its model, loss, data and evaluation into the shared engine.

A method is one module in this package exposing ``METHOD``, an instance of :class:`Method`.
Registering a new one is a line in ``_MODULES``; the engine never changes.
"""

from __future__ import annotations

import difflib
import importlib

from mmpt.methods.base import Method, MethodConfig

_MODULES = {
    "clip": "mmpt.methods.clip",
    "m2_encoder": "mmpt.methods.m2_encoder",
    "open_clip": "mmpt.methods.open_clip",
    "space2": "mmpt.methods.space2",
    "victor": "mmpt.methods.victor",
}


def list_methods() -> list[str]:
    return sorted(_MODULES)


def get_method(name: str | None) -> Method:
    from mmpt.config import ConfigError

    if name not in _MODULES:
        close = difflib.get_close_matches(str(name), list(_MODULES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"config key 'method.name' = {name!r} is not a known method{hint}; known: {', '.join(list_methods())}")
    return importlib.import_module(_MODULES[name]).METHOD


def method_config_class(name: str | None) -> type[MethodConfig]:
    return get_method(name).config_class


__all__ = ["Method", "MethodConfig", "get_method", "list_methods", "method_config_class"]
