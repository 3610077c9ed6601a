"""Reading the official M²-Encoder checkpoints (`.ckpt`) into `M2Encoder` with strict checking.

The official files come as a PyTorch Lightning checkpoint (`state_dict`), a DeepSpeed one (`module`,
keys prefixed `_forward_module.`), a `model` dict, or a raw state dict. Loading never unpickles code:
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F

from mmpt.models.m2_encoder import FIRST_POSITION, M2Encoder
from mmpt.models.tensor_files import CheckpointMismatch, MappedCheckpoint, load_strictly, read_safetensors

DEEPSPEED_PREFIX = "_forward_module."
VISION_POSITIONS = "backbone.encoder.embed_positions.A.weight"
SCALARS = ("logit_scale", "logit_vl_scale")


def read_official(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refused(path, exc) from None
    return unwrap_official(obj, path)


def unwrap_official(obj: object, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict inside what an official file saved, under this model's key names (the DeepSpeed prefix
    taken off, the training-only visual-tokenizer weights left out)."""
    if not isinstance(obj, dict):
        raise CheckpointMismatch(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    state: dict = obj
    for key in ("state_dict", "module", "model"):
        if isinstance(obj.get(key), dict):
            state = obj[key]
            break
    return {
        (k[len(DEEPSPEED_PREFIX) :] if k.startswith(DEEPSPEED_PREFIX) else k): v
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and "visual_tokenizer" not in k
    }


def _refused(path: str | os.PathLike, exc: Exception) -> CheckpointMismatch:
    return CheckpointMismatch(
        f"{path}: refusing to load, it holds pickled objects beyond tensors ({str(exc).splitlines()[0]}); "
        "re-save its state dict alone (torch.save(ckpt['state_dict'], ...)) from a trusted environment"
    )


def convert_official(state: dict[str, torch.Tensor], model: M2Encoder) -> dict[str, torch.Tensor]:
    """Official keys -> this model's, tensor by tensor (`convert_tensor`)."""
    return {k: convert_tensor(k, v, model.cfg.num_patches) for k, v in state.items()}


def convert_tensor(name: str, tensor: torch.Tensor, num_patches: int) -> torch.Tensor:
    """One official tensor as this model holds it: 0-D scales -> [1], the vision position table fitted to the
    configured patch grid; the rest as it is."""
    if name in SCALARS and tensor.dim() == 0:
        return tensor.reshape(1)
    if name == VISION_POSITIONS:
        return fit_positions(tensor, num_patches)
    return tensor


def converted_shape(name: str, shape: tuple[int, ...], num_patches: int) -> tuple[int, ...]:
    """The shape `convert_tensor` gives a tensor of `shape`, known before reading it."""
    if name in SCALARS and shape == ():
        return (1,)
    if name == VISION_POSITIONS and len(shape) == 2:
        return (FIRST_POSITION + 1 + num_patches, shape[1])
    return shape


class OfficialTensors:
    """An official checkpoint read tensor by tensor (a `TensorReader`), converted as `load_official` converts
    it whole: for a model built partitioned, which no process holds whole."""

    def __init__(self, path: str | os.PathLike, num_patches: int):
        try:
            self._file = MappedCheckpoint(Path(path), lambda obj: unwrap_official(obj, path))
        except pickle.UnpicklingError as exc:
            raise _refused(path, exc) from None
        self._patches, self.name = num_patches, str(path)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: converted_shape(k, shape, self._patches) for k, shape in self._file.shapes().items()}

    def read(self, name: str) -> torch.Tensor:
        return convert_tensor(name, self._file.read(name), self._patches)


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
    return load_strictly(model, convert_official(read_official(path), model), str(path), "this M2-Encoder config")


def load_release_weights(model: M2Encoder, directory: str | os.PathLike) -> M2Encoder:
    """Load an mmpt release's or finished run's `model.safetensors` strictly (a mismatch names the keys)."""
    directory = Path(directory)
    return load_strictly(model, read_safetensors(directory), str(directory), "this M2-Encoder config")
