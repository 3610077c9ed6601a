"""How the command-line tools in `launch/` end on an expected error: one `mmpt:` line and a documented exit
code (`mmpt.engine.stops`: 2 for a config, path or argument that cannot work, 3 for unusable data), never
a traceback. `MMPT_DEBUG=1` shows the traceback instead."""

from __future__ import annotations

from collections.abc import Callable

from mmpt.artifacts import ReleaseError
from mmpt.config import ConfigError
from mmpt.data.shards import DataError, MissingDataError
from mmpt.engine import stops
from mmpt.models.tensor_files import CheckpointMismatch

# OSError's path errors: a file or folder named on the command line or in a config that is not there.
USER_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    ReleaseError,
    CheckpointMismatch,
)


def exit_code(exc: BaseException) -> int | None:
    if isinstance(exc, (*USER_ERRORS, MissingDataError)):
        return stops.EXIT_CONFIG
    if isinstance(exc, DataError):
        return stops.EXIT_DATA
    return None


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """`main(argv)`, with an expected error said in one line and turned into its exit code."""
    try:
        return main(argv)
    except Exception as exc:
        code = exit_code(exc)
        if code is None or stops.debugging():
            raise
        stops.say(stops.one_line(exc))
        return code
