"""Demo corpora: small datasets mmpt generates itself (nothing is downloaded), for the demos and tests.

A corpus is a module of this package whose builder is decorated with `@register("<name>")`; the
builder takes the corpus folder and returns it once complete. A config's `data.prepare: <name>`
builds it under `data.root/<name>` on first use (`build`). Adding a corpus is adding a module here.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable
from pathlib import Path

Builder = Callable[..., Path]
_BUILDERS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    def add(builder: Builder) -> Builder:
        if name in _BUILDERS and _BUILDERS[name] is not builder:
            raise ValueError(f"demo corpus {name!r} is registered twice")
        _BUILDERS[name] = builder
        return builder

    return add


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def corpora() -> list[str]:
    """Names of every registered demo corpus."""
    _discover()
    return sorted(_BUILDERS)


def build(name: str, parent: str | os.PathLike, **options) -> Path:
    """Build corpus `name` in `parent/name` unless it is already complete; its folder."""
    if name not in corpora():
        raise KeyError(f"unknown demo corpus {name!r}; known: {', '.join(corpora())}")
    return _BUILDERS[name](Path(parent) / name, **options)
