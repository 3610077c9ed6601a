"""Memory and speed switches every image and video tower offers, off by default.

- `grad_checkpointing` keeps only each block's input in the forward pass and recomputes the block in the
  backward (non-reentrant `torch.utils.checkpoint`): the tower's activations shrink to about one block's
  worth, for about one more forward pass of compute.
- `patch_dropout` (FLIP, arXiv 2212.00794) drops that fraction of a training image's patch tokens after the
  position embedding, before the transformer blocks; the class token is kept, evaluation sees every patch.
  A tower then costs about (1 - p) of its compute and activations. It needs patch tokens: a ViT-style tower.

The random patch choice is drawn on the tensors' device (timm's `PatchDropout`), with no host round trip.
"""

from __future__ import annotations

from typing import Any

import timm
from pydantic import Field

from mmpt.config import ConfigError, Section


class TowerSwitches(Section):
    grad_checkpointing: bool = Field(
        default=False, description="recompute the tower's blocks in the backward pass (less memory, ~1/3 more compute)"
    )
    patch_dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="FLIP: drop this fraction of a training image's patch tokens (ViT-style towers; evaluation "
        "keeps all)",
    )


def timm_tower(name: str, kwargs: dict[str, Any], switches: TowerSwitches, key: str) -> Any:
    """A timm backbone without classifier or pretrained weights, with the tower's switches applied. A model
    without patch tokens asked for patch dropout is a ConfigError naming `key` (the config section)."""
    extra: dict[str, Any] = {"patch_drop_rate": switches.patch_dropout} if switches.patch_dropout else {}
    try:
        model: Any = timm.create_model(name, pretrained=False, num_classes=0, **kwargs, **extra)
    except TypeError as exc:
        if extra and "patch_drop_rate" in str(exc):
            raise ConfigError(
                f"config key '{key}.patch_dropout': timm model {name!r} has no patch tokens (patch dropout needs "
                "a ViT-style model); set it to 0"
            ) from None
        raise
    model.set_grad_checkpointing(switches.grad_checkpointing)
    return model
