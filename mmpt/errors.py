"""The error every layer may raise for a setting that cannot work. It lives below everything else so that
low layers (the process layout, the loader) can name a config key without importing the config schema."""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A config that cannot run; the message is one line meant for the user."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name where it has none): what a one-line error quotes of
    a library's multi-line one."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def missing_folder(source: str) -> bool:
    """Whether `source`, where a local folder or a hub name (`name`, `org/name`) is accepted, can only be a folder,
    and none is there: hub names never start with `/`, `.` or `~`, nor hold two `/`. Said as such, not as the hub
    client's complaint about a malformed repository id."""
    local = source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source
    return local and not Path(source).expanduser().exists()
