"""Demo corpora: small datasets mmpt generates itself (nothing is downloaded), for the demos and tests.

A corpus is a module of this package whose builder is decorated with `@register("<name>")`, listed in
`CORPORA`' built-ins; the builder takes the corpus folder and returns it once complete. A config's
`data.prepare: <name>` builds it under `data.root/<name>` on first use (`build`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from mmpt.registry import Registry

Builder = Callable[..., Path]
CORPORA: Registry[Builder] = Registry(
    "demo corpus",
    builtin={"digits": "mmpt.demo.digits", "dialogs": "mmpt.demo.dialogs", "moving_digits": "mmpt.demo.moving_digits"},
)
register = CORPORA.register
log = logging.getLogger(__name__)


def corpora() -> list[str]:
    """Names of every registered demo corpus."""
    return CORPORA.names()


def build(name: str, parent: str | os.PathLike, **options) -> Path:
    """Build corpus `name` in `parent/name` unless it is already complete; its folder."""
    from mmpt.demo.corpus import COMPLETE_MARKER

    folder = Path(parent) / name
    if not (folder / COMPLETE_MARKER).is_file():
        log.info("building the %s demo corpus in %s (once: later uses read it)", name, folder)
    return CORPORA.get(name)(folder, **options)
