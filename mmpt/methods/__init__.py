"""Method registry: a method plugs its model, loss, data and evaluation into the shared engine.

A method of mmpt is one module in this package exposing ``METHOD``, an instance of :class:`Method`,
listed in ``_MODULES``. A method defined elsewhere calls :func:`register` when its module is imported
(`launch/train.py --import MODULE`); see docs/adding_a_method.md. The engine never changes.
"""

from __future__ import annotations

import difflib
import importlib

from mmpt.methods.base import AfterStep, EngineNeeds, Method, MethodConfig

_MODULES = {
    "clip": "mmpt.methods.clip",
    "m2_encoder": "mmpt.methods.m2_encoder",
    "open_clip": "mmpt.methods.open_clip",
    "space2": "mmpt.methods.space2",
    "victor": "mmpt.methods.victor",
}


_REGISTERED: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Make `method` known by its `name`, for configs that say `method.name: <name>`; returns it."""
    known = _REGISTERED.get(method.name)
    if method.name in _MODULES or (known is not None and type(known) is not type(method)):
        raise ValueError(f"a method named {method.name!r} is already registered")
    _REGISTERED[method.name] = method
    return method


def list_methods() -> list[str]:
    return sorted({*_MODULES, *_REGISTERED})


def get_method(name: str | None) -> Method:
    from mmpt.config import ConfigError

    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _MODULES:
        close = difflib.get_close_matches(str(name), list_methods(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"config key 'method.name' = {name!r} is not a known method{hint}; known: {', '.join(list_methods())}")
    return importlib.import_module(_MODULES[name]).METHOD


def method_config_class(name: str | None) -> type[MethodConfig]:
    return get_method(name).config_class


__all__ = ["AfterStep", "EngineNeeds", "Method", "MethodConfig", "get_method", "list_methods", "method_config_class",
           "register"]
