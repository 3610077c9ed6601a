"""Reading the official M²-Encoder checkpoints (`.ckpt`) into `M2Encoder` with strict checking.

The official files come as a PyTorch Lightning checkpoint (`state_dict`), a DeepSpeed one (`module`,
keys prefixed `_forward_module.`), a `model` dict, or a raw state dict. Loading never unpickles code:
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import math
import os
import pickle
from typing import Any

import torch
import torch.nn.functional as F

from mmpt.models.m2_encoder import FIRST_POSITION, M2Encoder

DEEPSPEED_PREFIX = "_forward_module."
VISION_POSITIONS = "backbone.encoder.embed_positions.A.weight"
SCALARS = ("logit_scale", "logit_vl_scale")


class CheckpointMismatch(RuntimeError):
    """The checkpoint's keys or shapes do not match the configured model."""


def read_official(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointMismatch(
            f"{path}: refusing to load, it holds pickled objects beyond tensors ({str(exc).splitlines()[0]}); "
            "re-save its state dict alone (torch.save(ckpt['state_dict'], ...)) from a trusted environment"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointMismatch(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    for key in ("state_dict", "module", "model"):
        if isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    return {
        (k[len(DEEPSPEED_PREFIX) :] if k.startswith(DEEPSPEED_PREFIX) else k): v
        for k, v in obj.items()
        if isinstance(v, torch.Tensor)
    }


def convert_official(state: dict[str, torch.Tensor], model: M2Encoder) -> dict[str, torch.Tensor]:
    """Official keys -> this model's: drop training-only visual-tokenizer weights, 0-D scales -> [1],
    and fit the vision position table to the configured patch grid."""
    state = {k: v for k, v in state.items() if "visual_tokenizer" not in k}
    for key in SCALARS:
        if key in state and state[key].dim() == 0:
            state[key] = state[key].reshape(1)
    if VISION_POSITIONS in state:
        state[VISION_POSITIONS] = fit_positions(state[VISION_POSITIONS], model.cfg.num_patches)
    return state


def fit_positions(table: torch.Tensor, num_patches: int) -> torch.Tensor:
    """Rows 0..2 (two unused + CLS) kept; the square grid of patch rows area-resized to `num_patches`.

    The official loader resizes a smaller grid and truncates a larger one; we resize both ways,
    which agrees with it on every official checkpoint (all have the 224-pixel grid).
    """
    rows = FIRST_POSITION + 1 + num_patches
    if table.shape[0] == rows:
        return table
    head, grid = table[: FIRST_POSITION + 1], table[FIRST_POSITION + 1 :]
    side, target = math.isqrt(grid.shape[0]), math.isqrt(num_patches)
    grid = grid.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(target, target), mode="area").permute(0, 2, 3, 1).reshape(target * target, -1)
    return torch.cat([head, grid])


def load_official(model: M2Encoder, path: str | os.PathLike) -> M2Encoder:
    """Load an official checkpoint strictly; a mismatch names every missing/unexpected/mis-shaped key."""
    state = convert_official(read_official(path), model)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k}: checkpoint {list(state[k].shape)} vs model {list(expected[k].shape)}"
        for k in sorted(set(state) & set(expected))
        if state[k].shape != expected[k].shape
    ]
    if missing or unexpected or shapes:
        parts = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
            if items:
                parts.append(f"{title} ({len(items)}): {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}")
        raise CheckpointMismatch(f"{path} does not fit this M2-Encoder config: " + "; ".join(parts))
    model.load_state_dict(state, strict=True)
    return model


def load_release_weights(model: M2Encoder, directory: str | os.PathLike) -> M2Encoder:
    """Load an mmpt release's or finished run's `model.safetensors` strictly (a mismatch names the keys)."""
    from huggingface_hub import load_torch_model

    result: Any = load_torch_model(model, directory, strict=False, safe=True, weights_only=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointMismatch(
            f"{directory} does not fit this M2-Encoder config: missing "
            f"{sorted(result.missing_keys)[:8]}, unexpected {sorted(result.unexpected_keys)[:8]}"
        )
    return model
