"""A run's config from its YAML file: the shared sections (`mmpt.config`) plus the `method:` section,
which the method named there validates with its own schema and cross-section checks (`mmpt.methods`).

Kept apart from `mmpt.config` so that the schema knows nothing of the methods that extend it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

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
    if "zeroshot" in section and "zeroshot" not in method.config_class.model_fields:
        data = zeroshot_as_eval_sets(data, origins, top_file)
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


LEGACY_ZEROSHOT_KEYS = ("dataset", "extra_datasets", "languages", "batch_size", "foreign_class_names")


def zeroshot_as_eval_sets(data: dict, origins: dict[str, str], top_file: str) -> dict:
    """`data` with a `method.zeroshot` section (how configs named the zero-shot sets of the image-text methods
    before every evaluation set was a `data.eval` entry, as releases' config.json and runs' config.yaml still
    do) read as what it meant: `dataset` and each of `extra_datasets` a zeroshot_classification entry of
    `data.eval` in `languages` (none when `dataset` is null), and `batch_size` as `method.eval_batch_size`.
    Warns, naming the file, with what to write instead."""
    where = origin(origins, "method.zeroshot", top_file)
    legacy = data["method"]["zeroshot"]
    if not isinstance(legacy, dict):
        raise ConfigError(f"{where}: config key 'method.zeroshot' must be a mapping (better: data.eval entries)")
    for key in legacy:
        if key not in LEGACY_ZEROSHOT_KEYS:
            raise ConfigError(
                f"{where}: unknown config key 'method.zeroshot.{key}' (method.zeroshot is read as data.eval entries)"
            )
    method = {k: v for k, v in data["method"].items() if k != "zeroshot"}
    if "batch_size" in legacy:
        method.setdefault("eval_batch_size", legacy["batch_size"])
    section = data.get("data")
    sets: list[Any] = list(section.get("eval") or []) if isinstance(section, dict) else []
    added = []
    if legacy.get("dataset") is not None:
        extra = legacy.get("extra_datasets") or []
        for dataset in [legacy["dataset"], *(extra if isinstance(extra, list) else [extra])]:
            entry: dict[str, Any] = {"dataset": dataset, "task": "zeroshot_classification"}
            for key in ("languages", "foreign_class_names"):
                if key in legacy:
                    entry[key] = legacy[key]
            if not any(
                isinstance(s, dict) and s.get("dataset") == dataset and s.get("task") == entry["task"] for s in sets
            ):
                origins[f"data.eval.{len(sets)}"] = where
                sets.append(entry)
                added.append(str(dataset))
    upgraded = {**data, "method": method}
    if isinstance(section, dict):
        upgraded["data"] = {**section, "eval": sets}
    written = f"data.eval entries ({', '.join(added)})" if added else "no evaluation set (its dataset is null)"
    warnings.warn(
        f"{where}: 'method.zeroshot' is read as {written}; name evaluation sets in data.eval instead "
        "(docs/evaluation.md)",
        FutureWarning,
        stacklevel=3,
    )
    return upgraded
