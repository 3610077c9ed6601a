"""A CLIP_benchmark-compatible model loader for mmpt runs of image-text methods.

CLIP_benchmark calls `model, transform, tokenizer = loader(model_name, pretrained, cache_dir, device)`,
then `model.encode_text(tokenizer(texts).to(device))` and `model.encode_image(images)`. Our text
towers need the attention mask too (the GLM pad id equals its end-of-text id, so the mask cannot
be recovered from the ids), so the tokenizer returns ids and mask packed as one [n, 2, L] tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class PackedTextModel(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.model.encode_image(images, normalize=normalize)

    def encode_text(self, packed: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.model.encode_text(packed[:, 0], packed[:, 1], normalize=normalize)


class PackedTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        tokens = self.tokenizer([texts] if isinstance(texts, str) else list(texts))
        return torch.stack([tokens["input_ids"], tokens["attention_mask"]], dim=1)


def load_mmpt(model_name: str = "", pretrained: str = "", cache_dir: str | None = None, device: str = "cpu"):
    """(model, transform, tokenizer) of the run directory `pretrained` (`model_name` is unused)."""
    from mmpt.hub import load_run

    cfg, method, model = load_run(pretrained, device=device)
    run_dir = Path(pretrained)
    return (PackedTextModel(model).eval(), method.image_transform(cfg, train=False),
            PackedTokenizer(method.tokenizer(cfg, run_dir)))
