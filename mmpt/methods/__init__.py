"""Method registry: a method plugs its model, loss, data and evaluation into the shared engine.

A method of mmpt is one module in this package that registers an instance of :class:`Method` when
imported (``METHOD = register(MyMethod())``) and is listed in ``METHODS``' built-ins. A method defined
elsewhere calls :func:`register` the same way (`launch/train.py --import MODULE`); see
docs/adding_a_method.md. The engine never changes.
"""

from __future__ import annotations

from mmpt.errors import ConfigError
from mmpt.methods.base import AfterStep, EngineNeeds, Method, MethodConfig
from mmpt.registry import NotRegistered, Registry

METHODS: Registry[Method] = Registry(
    "method",
    builtin={
        "clip": "mmpt.methods.clip",
        "m2_encoder": "mmpt.methods.m2_encoder",
        "open_clip": "mmpt.methods.open_clip",
        "space2": "mmpt.methods.space2",
        "transformers": "mmpt.methods.transformers_dual",
        "victor": "mmpt.methods.victor",
    },
)


def register(method: Method) -> Method:
    """Make `method` known by its `name`, for configs that say `method.name: <name>`; returns it."""
    return METHODS.register(method.name, method)


def list_methods() -> list[str]:
    return METHODS.names()


def get_method(name: str | None) -> Method:
    try:
        return METHODS.get(str(name))
    except NotRegistered as exc:
        raise ConfigError(f"config key 'method.name' = {exc}") from None


__all__ = ["METHODS", "AfterStep", "EngineNeeds", "Method", "MethodConfig", "get_method", "list_methods", "register"]
