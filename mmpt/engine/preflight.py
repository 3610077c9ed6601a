"""Every file a config names is checked before any process group starts.

A missing tokenizer, shard set, evaluation set or resume path found after the ranks have started costs
a cluster allocation and, under a requeueing scheduler, several; found here it is one line naming the
config key and the path, and exit code 2 (`mmpt.engine.stops`).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import torch

from mmpt.artifacts import ReleaseError
from mmpt.config import Config, ConfigError, SourceConfig
from mmpt.data.fields import MissingFieldError, missing_field
from mmpt.data.loader import first_samples
from mmpt.data.shards import DataError, expand_shards, is_remote
from mmpt.data.stream import check_epoch_shards
from mmpt.eval import DEMO_NAMES
from mmpt.eval.retrieval_formats import is_shard_pattern
from mmpt.methods import Method
from mmpt.methods.teacher import check_teacher

WILDCARDS = "*?[{"


def check_inputs(cfg: Config, method: Method) -> None:
    """Raise ConfigError for the first config key whose file or folder does not exist.

    Remote shard URLs are not checked; paths under `data.root` are not when `data.prepare` will build them.
    """
    demo_root = Path(cfg.data.root).resolve() if cfg.data.prepare else None

    def built_later(path: str) -> bool:
        return demo_root is not None and Path(literal_prefix(path)).resolve().is_relative_to(demo_root)

    train = cfg.data.train
    readers = launched_ranks() // cfg.train.sequence_parallel * max(1, train.num_workers)
    for index, source in enumerate(train.sources):
        if built_later(source.shards):
            continue
        try:
            shards = expand_shards(source.shards)
            if train.mode == "epoch":
                check_epoch_shards(source.name or source.shards, len(shards), readers)
        except DataError as exc:
            raise ConfigError(f"config key 'data.train.sources.{index}.shards': {exc}") from None
        check_named_fields(f"data.train.sources.{index}", source, shards[0])
    if cfg.run.resume not in ("auto", "none") and not Path(cfg.run.resume).exists():
        raise ConfigError(
            f"config key 'run.resume': {cfg.run.resume} does not exist (auto: the newest checkpoint "
            "in run.output_dir, if any; none: start afresh)"
        )
    if cfg.run.wandb is not None and cfg.run.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "config key 'run.wandb': logging to Weights & Biases needs the wandb package "
            "(pip install 'mmpt[wandb]'), or remove the key"
        )
    check_eval_every(cfg)
    for index, eval_set in enumerate(cfg.data.eval):
        key, dataset = f"data.eval.{index}.dataset", eval_set.dataset
        if dataset in DEMO_NAMES or built_later(dataset):
            continue
        if is_shard_pattern(dataset):
            try:
                expand_shards(dataset)
            except DataError as exc:
                raise ConfigError(f"config key '{key}': {exc}") from None
        elif not Path(dataset).exists():
            raise ConfigError(f"config key '{key}': {dataset} does not exist")
    try:
        method.resolve_defaults(cfg)
        paths = method.input_paths(cfg)
    except (FileNotFoundError, ReleaseError) as exc:  # a path the method could not resolve (a package not installed)
        raise ConfigError(str(exc)) from None
    for key, path in paths.items():
        if path is not None and not built_later(path) and not Path(path).exists():
            raise ConfigError(f"config key '{key}': {path} does not exist")
    try:
        method.check_eval_sets(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    method.check_initial_weights(cfg)
    if getattr(cfg.method, "distill", None) is not None:
        check_teacher(cfg)
    if getattr(cfg.method, "lora", None) is not None:
        check_adapters(cfg, method)


def check_named_fields(key: str, source: SourceConfig, first_shard: str) -> None:
    """A field key (caption_key, image_key, video_key) that none of the first samples holds, a typo most often,
    is one line naming the key and what the samples do hold: not a run that skips every sample until its skip
    policy stops it."""
    fields = source.sample_fields()
    named = {what: getattr(fields, what) for what in source.fields_set()}
    if not named or is_remote(first_shard):
        return
    samples = first_samples(first_shard)
    for what, keys in named.items():
        missing = []
        for sample in samples:
            try:
                if what == "caption":
                    fields.captions(sample)
                elif not any(k in sample for k in keys):
                    raise MissingFieldError(missing_field(sample, what, keys))
            except MissingFieldError as exc:
                missing.append(str(exc))
            except ValueError:  # there, but not text: the loader counts such samples
                pass
        if samples and len(missing) == len(samples):
            first = f"none of the first {len(samples)} samples has it"
            raise ConfigError(f"config key '{key}.{what}_key': {first}: {missing[0]}")


def launched_ranks() -> int:
    """The ranks the launcher started (its WORLD_SIZE; 1 for a plain `python`), read before the process group."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


def check_adapters(cfg: Config, method: Method) -> None:
    """LoRA targets that match no layer are found by building the model without memory (on the meta device)."""
    with tempfile.TemporaryDirectory() as scratch, torch.device("meta"):
        method.prepare(cfg, Path(scratch))
        method.build_model(cfg, Path(scratch))


def literal_prefix(pattern: str) -> str:
    """The part of a path or shard pattern before its first wildcard or brace."""
    cut = min((pattern.index(c) for c in WILDCARDS if c in pattern), default=len(pattern))
    return pattern[:cut] or "."


def check_eval_every(cfg: Config) -> None:
    """Refuse a `train.eval_every` that would evaluate nothing: no `data.eval` set, or more steps than the run
    has. Checked when a run starts, not when a config loads: a saved config (a release's) still loads."""
    every = cfg.train.eval_every
    if every and not cfg.data.eval:
        raise ConfigError(
            f"config key 'train.eval_every' = {every}: there is no data.eval set to evaluate "
            "(name one in data.eval, or set train.eval_every=0)"
        )
    if every > cfg.train.max_steps:
        raise ConfigError(
            f"config key 'train.eval_every' = {every} is more than train.max_steps ({cfg.train.max_steps}): "
            "it would never evaluate before the end (data.eval sets are evaluated at the end anyway)"
        )
