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
    if section is None:  # a preset (configs/base/) names none: configs that train extend it
        raise ConfigError(
            f"{top_file}: names no method (config key 'method', e.g. method: {{name: clip}}); a preset without "
            "one is for configs that name a method to extend (extends: [base/zero2])"
        )
    if not isinstance(section, dict):
        raise ConfigError(
            f"{origin(origins, 'method', top_file)}: config key 'method' must be a mapping with a "
            "'name' (e.g. method: {name: clip})"
        )
    try:
        method = get_method(section.get("name"))
    except ConfigError as exc:
        raise ConfigError(f"{origin(origins, 'method.name', top_file)}: {exc}") from None
    data = legacy_eval_sets(data, origins, top_file)
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


# Method sections that named evaluation sets before every set was a `data.eval` entry, as releases' config.json
# and runs' config.yaml still do: {section: (the entries' task, the section's keys read as entries)}. The rest of
# a section stays where it is, but for `zeroshot`, which goes whole (its `batch_size`: `method.eval_batch_size`).
LEGACY_EVAL_SECTIONS = {
    "zeroshot": ("zeroshot_classification", ("dataset", "extra_datasets", "languages", "foreign_class_names")),
    "retrieval": ("zeroshot_retrieval", ("dataset", "languages")),
    "intent_eval": ("intent", ("dataset",)),
}


def legacy_eval_sets(data: dict, origins: dict[str, str], top_file: str) -> dict:
    """`data` with the evaluation sets its method sections name (`LEGACY_EVAL_SECTIONS`) read as what they meant:
    `dataset` and each of `extra_datasets` a `data.eval` entry in `languages` (none when `dataset` is null). Warns,
    naming the file, with what to write instead."""
    method, section = dict(data["method"]), data.get("data")
    sets: list[Any] = list(section.get("eval") or []) if isinstance(section, dict) else []
    for name, (task, keys) in LEGACY_EVAL_SECTIONS.items():
        if name not in method:
            continue
        legacy = method[name]
        if not isinstance(legacy, dict):
            where = origin(origins, f"method.{name}", top_file)
            raise ConfigError(f"{where}: config key 'method.{name}' must be a mapping (better: data.eval entries)")
        named = [k for k in keys if k in legacy]
        if not named:
            continue  # a section that names no set (VICTOR's retrieval settings, SPACE-2's intent protocol)
        where = origin(origins, f"method.{name}.{named[0]}", top_file)  # the file that names a set there
        rest = {k: v for k, v in legacy.items() if k not in keys}
        if name == "zeroshot":
            for key in rest.keys() - {"batch_size"}:
                raise ConfigError(f"{where}: unknown config key 'method.zeroshot.{key}' (read as data.eval entries)")
            if "batch_size" in rest:
                method.setdefault("eval_batch_size", rest["batch_size"])
            del method[name]
        else:
            method[name] = rest
        added = []
        if legacy.get("dataset") is not None:
            extra = legacy.get("extra_datasets") or []
            for dataset in [legacy["dataset"], *(extra if isinstance(extra, list) else [extra])]:
                entry = {"dataset": dataset, "task": task}
                entry.update({k: legacy[k] for k in ("languages", "foreign_class_names") if k in legacy})
                if not any(isinstance(s, dict) and s.get("dataset") == dataset and s.get("task") == task for s in sets):
                    origins[f"data.eval.{len(sets)}"] = where
                    sets.append(entry)
                    added.append(str(dataset))
        written = (
            f"data.eval entries ({', '.join(added)})"
            if added
            else "no evaluation set (its dataset is null)"
            if legacy.get("dataset") is None
            else f"no new evaluation set (data.eval has {legacy['dataset']} already)"
        )
        warnings.warn(
            f"{where}: 'method.{name}' is read as {written}; name evaluation sets in data.eval instead "
            "(docs/evaluation.md)",
            FutureWarning,
            stacklevel=3,
        )
    upgraded = {**data, "method": method}
    if isinstance(section, dict):
        upgraded["data"] = {**section, "eval": sets}
    return upgraded
