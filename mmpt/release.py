"""Released checkpoints: a directory with `config.json`, safetensors weights (sharded when large), the
files the model needs besides weights (tokenizer, backbone config) and a model card (`README.md`,
`mmpt.export.card`), loadable from a local path or a Hugging Face hub id.

A finished training run (`config.yaml` + `model.safetensors`) loads the same way, so a run is
usable before it is exported. Nothing is unpickled: weights are safetensors only.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmpt.artifacts import (
    RELEASE_CONFIG,
    RELEASE_FORMAT,
    RUN_CONFIG,
    ReleaseError,
    has_weights,
    release_record,
    shareable,
)
from mmpt.config import Config
from mmpt.config_loader import load_config, validate_config
from mmpt.export.card import CARD, release_card, training_record
from mmpt.methods import Method, get_method
from mmpt.models.tensor_files import load_strictly, read_safetensors


class PretrainedModel(nn.Module):
    """A loaded model with the config it was built from; `save_pretrained(dir)` writes a release.

    Attribute access falls through to the wrapped model, so `encode_image`, `encode_text`,
    `encode_dialog` and the rest are the model's own.
    """

    def __init__(self, model: nn.Module, config: Config, files_from: Path):
        super().__init__()
        self.model = model
        self.config = config
        self.files_from = Path(files_from)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @property
    def method(self) -> Method:
        return get_method(self.config.method_name)

    def preprocessors(self) -> dict[str, Any]:
        return self.method.preprocessors(self.config, self.files_from)

    def save_pretrained(self, directory: str | os.PathLike, max_shard_size: int | str = "2GB") -> Path:
        state = {k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()}
        return save_release(directory, self.config, state, self.files_from, max_shard_size=max_shard_size)


def model_config(method: dict[str, Any]) -> Config:
    """A config for a model built outside training: the method section, placeholder training sections."""
    return validate_config(
        {
            "method": method,
            "run": {"output_dir": "."},
            "optim": {"lr": 1e-4},
            "data": {"train": {"sources": [{"shards": "none"}], "batch_size": 1}},
            "train": {"max_steps": 1, "grad_clip": 0.0},
        },
        top_file="<model config>",
    )


def save_release(
    directory: str | os.PathLike,
    cfg: Config,
    state_dict: dict[str, torch.Tensor],
    files_from: str | os.PathLike,
    max_shard_size: int | str = "2GB",
) -> Path:
    """Write a release: config.json, weights (model.safetensors, or shards + index), the method's files, and
    the model card (README.md) with the training facts of the run in `files_from` (or those the release
    there carries)."""
    from huggingface_hub import save_torch_state_dict

    directory, files_from = Path(directory), Path(files_from)
    directory.mkdir(parents=True, exist_ok=True)
    training = training_record(files_from)  # read before this folder's config.json is (re)written
    method = get_method(cfg.method_name)
    made = [name for name in method.release_files(cfg) if not (files_from / name).exists()]
    if made:  # a run from before the method kept them: made from the config, as a run's start makes them
        method.prepare(cfg, directory)
    for name in method.release_files(cfg):
        source, target = files_from / name, directory / name
        if source.resolve() == target.resolve() or (name in made and target.exists()):
            continue
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copyfile(source, target)
        else:
            raise ReleaseError(f"{source} is missing: the '{cfg.method_name}' model needs it besides its weights")
    save_torch_state_dict(state_dict, directory, max_shard_size=max_shard_size)
    for written in directory.glob("model*.safetensors*"):
        shareable(written)
    record = {"format": RELEASE_FORMAT, "version": 1, "method": cfg.method_name, "config": cfg.to_dict()}
    if training is not None:
        record["training"] = training
    (directory / RELEASE_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
    card = release_card(directory, cfg, state_dict, files_from, training)
    (directory / CARD).write_text(card, encoding="utf-8")
    return directory


def read_config(directory: Path) -> Config:
    """The config of a release (config.json) or of a training run (config.yaml), pointing at the files the
    folder carries."""
    if (directory / RELEASE_CONFIG).is_file():
        cfg = validate_config(release_record(directory)["config"], top_file=str(directory / RELEASE_CONFIG))
    elif (directory / RUN_CONFIG).is_file():
        cfg = load_config(directory / RUN_CONFIG)
    else:
        raise ReleaseError(f"{directory} has neither {RELEASE_CONFIG} (a release) nor {RUN_CONFIG} (a training run)")
    get_method(cfg.method_name).use_carried_files(cfg, directory)
    return cfg


def load_directory(directory: str | os.PathLike, device: str | torch.device = "cpu") -> PretrainedModel:
    """The model of a release or finished run directory, weights loaded strictly, in eval mode."""
    directory = Path(directory)
    cfg = read_config(directory)
    if not has_weights(directory):
        raise ReleaseError(
            f"{directory} has no model.safetensors (or model.safetensors.index.json): not a finished "
            "run or release; launch/export.py makes one from a run's checkpoints"
        )
    return built_model(cfg, read_safetensors(directory), directory).to(device)


def built_model(cfg: Config, state: Mapping[str, torch.Tensor], files_from: Path) -> PretrainedModel:
    """The model of `cfg` (its files in `files_from`) with `state` loaded strictly, in eval mode."""
    model = get_method(cfg.method_name).build_model(cfg, files_from)
    load_strictly(model, state, str(files_from / "model.safetensors"), f"the '{cfg.method_name}' model")
    return PretrainedModel(model, cfg, files_from).eval()


def load_run(run_dir: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Config, Method, nn.Module]:
    """(config, method, model in eval mode) of a run or release directory; weights are loaded strictly."""
    loaded = load_directory(run_dir, device)
    return loaded.config, loaded.method, loaded.model
