"""A run's config from its YAML file: the shared sections (`mmpt.config`) plus the `method:` section,
which the method named there validates with its own schema and cross-section checks (`mmpt.methods`).

Kept apart from `mmpt.config` so that the schema knows nothing of the methods that extend it.
"""

from __future__ import annotations

import os

from mmpt.config import Config, ConfigError, origin, read_config, validate_sections
from mmpt.methods import get_method


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load, merge bases, apply `key.path=value` overrides and validate; raises ConfigError."""
    return validate_config(*read_config(path, overrides))


def validate_config(data: dict, origins: dict[str, str] | None = None, top_file: str = "<config>") -> Config:
    """`data` (a config's merged mapping) as a Config; errors name the key and the file that set it."""
    origins = origins or {}
    section = data.get("method")
    if not isinstance(section, dict):
        raise ConfigError(
            f"{origin(origins, 'method', top_file)}: config key 'method' must be a mapping with a "
            "'name' (e.g. method: {name: clip})"
        )
    try:
        method = get_method(section.get("name"))
    except ConfigError as exc:
        raise ConfigError(f"{origin(origins, 'method.name', top_file)}: {exc}") from None
    cfg = validate_sections(data, origins, top_file, method.config_class)
    for index, source in enumerate(cfg.data.train.sources):
        for name in source.fields_set():
            if name not in method.sample_fields:
                key = f"data.train.sources.{index}.{name}_key"
                reads = ", ".join(f"{f}_key" for f in method.sample_fields) or "no field keys"
                raise ConfigError(
                    f"{origin(origins, key, top_file)}: config key '{key}': method '{method.name}' reads {reads}"
                )
    for index, eval_set in enumerate(cfg.data.eval):
        for name in eval_set.fields_set():
            if name not in method.eval_sample_fields:
                key = f"data.eval.{index}.{name}_key"
                raise ConfigError(
                    f"{origin(origins, key, top_file)}: config key '{key}': method '{method.name}' reads "
                    "no field keys of evaluation sets"
                )
        if eval_set.task not in method.eval_tasks:
            key = f"data.eval.{index}.task"
            offers = ", ".join(method.eval_tasks) or "no evaluation sets"
            raise ConfigError(
                f"{origin(origins, key, top_file)}: config key '{key}' = {eval_set.task!r}: method "
                f"'{method.name}' offers {offers}"
            )
    try:
        method.check_config(cfg)
    except ValueError as exc:
        raise ConfigError(f"{top_file}: {exc}") from None
    return cfg
