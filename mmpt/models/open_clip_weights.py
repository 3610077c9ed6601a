"""open_clip's pretrained weights: found the way open_clip finds them, read without running code, checked
against the architecture before training.

`method.pretrained` names one of:
- a local file in open_clip's formats: a state dict (`.pt`, `.bin`, `.safetensors`) or an `open_clip_train`
  checkpoint (its `state_dict`, `module.` prefixes and all);
- `hf-hub:org/name`: the weights file of that Hugging Face repository (open_clip's file names);
- a pretrained tag of the architecture (`open_clip.list_pretrained_tags_by_model`): open_clip's cache, then a
  download where a network exists (`HF_HUB_OFFLINE=1` keeps it to the cache).
Pickled files are read with `weights_only` (no code runs), as open_clip's releases are.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import cast

import open_clip
import torch

from mmpt.config import ConfigError
from mmpt.errors import first_line
from mmpt.models.lora import base_state

KEY = "method.pretrained"
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def tag_settings(model: str, pretrained: str | None) -> dict:
    """What open_clip records of a pretrained tag of `model` (preprocessing, `quick_gelu`); {} for anything else."""
    if pretrained is None or pretrained.startswith("hf-hub:") or Path(pretrained).expanduser().exists():
        return {}
    return open_clip.get_pretrained_cfg(model, pretrained)


def tag_preprocessing(model: str, pretrained: str | None) -> dict:
    """The preprocessing a pretrained tag was trained with (mean, std, interpolation, resize mode), or {}."""
    found = tag_settings(model, pretrained)
    return {key: found[key] for key in ("mean", "std", "interpolation", "resize_mode") if found.get(key) is not None}


def weights_file(model: str, pretrained: str) -> Path:
    """The local file `pretrained` names for open_clip architecture `model` (fetched where it must be)."""
    path = Path(pretrained).expanduser()
    if path.is_file():
        return path
    if pretrained.startswith("hf-hub:"):
        try:
            return Path(open_clip.pretrained.download_pretrained_from_hf(pretrained[len("hf-hub:") :]))
        except Exception as exc:  # offline, no such repository, no weights file in it
            raise ConfigError(f"config key '{KEY}': cannot fetch {pretrained}: {first_line(exc)}") from None
    if path.suffix in WEIGHT_SUFFIXES or "/" in pretrained:
        raise ConfigError(f"config key '{KEY}': {pretrained} does not exist")
    found = open_clip.get_pretrained_cfg(model, pretrained)
    if not found:
        tags = ", ".join(open_clip.list_pretrained_tags_by_model(model)) or "none"
        raise ConfigError(
            f"config key '{KEY}': open_clip has no pretrained tag {pretrained!r} for {model} (its tags: {tags}), "
            "and no such file exists"
        )
    try:
        local = open_clip.download_pretrained(found)
    except Exception as exc:
        raise ConfigError(f"config key '{KEY}': cannot fetch {model} {pretrained}: {first_line(exc)}") from None
    if not local:
        raise ConfigError(f"config key '{KEY}': open_clip found no file for {model} {pretrained}")
    return Path(local)


NOT_TENSORS = (
    "not tensors that load without running code (a state dict saved with torch.save, a .safetensors file or an "
    "open_clip_train checkpoint)"
)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A state dict with open_clip's names from any of its formats (an open_clip_train checkpoint unwrapped)."""
    try:
        state = cast(dict[str, torch.Tensor], open_clip.factory.load_state_dict(str(path), weights_only=True))
    except Exception as exc:  # not a checkpoint, or a pickle that would run code
        # torch's own first line advises weights_only=False, which would run the file's code: not repeated here
        why = NOT_TENSORS if isinstance(exc, pickle.UnpicklingError) else first_line(exc)
        raise ConfigError(f"config key '{KEY}': cannot read {path} as open_clip weights: {why}") from None
    return {name.removeprefix("module."): tensor for name, tensor in state.items()}


def fit_to(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path, architecture: str) -> dict:
    """`state` shaped as `model` (open_clip's CLIP, scale and bias as [1]) holds it; ConfigError naming the first
    tensor that does not fit. The logit bias follows the loss: left out where the model has none (the contrastive
    loss chosen), the model's initial one (SigLIP's -10) where the weights have none (the sigmoid loss chosen)."""
    expected = base_state(model)  # the names without LoRA adapters, where the model has them
    if "logit_bias" not in expected:
        state = {name: tensor for name, tensor in state.items() if name != "logit_bias"}
    for name, tensor in expected.items():
        if name == "logit_bias" and name not in state:
            state[name] = tensor.detach().clone()
        if name not in state:
            raise ConfigError(f"config key '{KEY}': {path} has no tensor '{name}' that {architecture} has")
        found = state[name]
        if name in ("logit_scale", "logit_bias") and found.numel() == 1:
            state[name] = found = found.reshape(tensor.shape)
        if found.shape != tensor.shape:
            raise ConfigError(
                f"config key '{KEY}': {path} does not fit {architecture}: tensor '{name}' is "
                f"{list(found.shape)} there, {list(tensor.shape)} in the model"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ConfigError(f"config key '{KEY}': {path} has tensor '{extra[0]}', which {architecture} has not")
    return state
