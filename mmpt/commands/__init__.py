"""mmpt's command-line tools, one module each with a `main(argv)`; installed as `mmpt-<name>` commands
(pyproject's [project.scripts]) and run from a checkout as `python launch/<name>.py`."""

import argparse
import importlib


def add_import_option(parser: argparse.ArgumentParser, before: str) -> None:
    """`--import MODULE`, repeatable: modules to import (`import_modules`) before `before` is read."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help=f"a module to import before {before} is read, e.g. one that registers a method "
        "(mmpt.methods.register); may repeat",
    )


def import_modules(modules: list[str]) -> None:
    """Import each of `modules` (`--import`); one that cannot be imported is a ConfigError."""
    from mmpt.config import ConfigError

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"--import {module}: {exc} (is its folder on PYTHONPATH?)") from None
