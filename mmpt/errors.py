"""The error every layer may raise for a setting that cannot work. It lives below everything else so that
low layers (the process layout, the loader) can name a config key without importing the config schema."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot run; the message is one line meant for the user."""
