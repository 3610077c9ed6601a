"""mmpt's command-line tools, one module each with a `main(argv)`; installed as `mmpt-<name>` commands
(pyproject's [project.scripts]) and run from a checkout as `python launch/<name>.py`."""

import argparse
import importlib
from collections.abc import Callable


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


def installed(main: Callable[[list[str] | None], int]) -> Callable[[], int]:
    """The installed command running `main`: an expected error ends in one line and its exit code (`mmpt.cli`,
    imported when the command runs, not when its module is)."""

    def run() -> int:
        from mmpt import cli

        return cli.run(main)

    return run
