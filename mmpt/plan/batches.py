"""Synthetic micro-batches with the shapes a method's loader yields, at the longest text the config allows
(a plan is for the worst batch). Which layout applies follows from the sample fields a method reads."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from mmpt.config import Config
from mmpt.plan.build import Built

MLM_SHARE = 0.15  # the share of dialog tokens that MLM predicts (SPACE-2's mlm_probability default)


def micro_batch(b: Built, size: int) -> dict[str, Any]:
    """One micro-batch of `size` samples for `b`'s method, created on the current device and mode."""
    fields = set(b.method.sample_fields)
    if "image" in fields:
        return image_text(b, size)
    if "video" in fields:
        return video_text(b, size)
    return dialogs(b.cfg, size)


def setting(section: Any, name: str) -> Any:
    """`name` in a method section or in one of its subsections (arch, text, video), first found."""
    if hasattr(section, name):
        return getattr(section, name)
    for child in ("arch", "text", "video"):
        if hasattr(section, child) and hasattr(getattr(section, child), name):
            return getattr(getattr(section, child), name)
    raise KeyError(name)


def text_length(b: Built) -> int:
    try:
        chosen = setting(b.cfg.method, "context_length")
    except KeyError:
        chosen = None
    if chosen is not None:
        return int(chosen)
    inner = getattr(b.model, "clip", b.model)  # open_clip and transformers models keep their own length
    return int(getattr(inner, "context_length", 77))


def image_shape(b: Built) -> tuple[int, ...]:
    """The evaluation transform's output for a picture: the training crop has the same size."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    method: Any = b.method  # an image-text method (it reads images)
    transform = method.image_transform(b.cfg, train=False)
    with unset_fake_temporarily():  # a real picture through the real transform, even while measuring on fakes
        return tuple(transform(Image.new("RGB", (320, 320))).shape)


def image_text(b: Built, size: int) -> dict[str, Any]:
    length = text_length(b)
    batch = {
        "image": torch.randint(0, 256, (size, *image_shape(b)), dtype=torch.uint8),
        "input_ids": torch.randint(1, 100, (size, length)),
    }
    if getattr(b.method, "uses_attention_mask", True):
        batch["attention_mask"] = torch.ones(size, length, dtype=torch.long)
    return batch


def video_text(b: Built, size: int) -> dict[str, Any]:
    video, length = b.cfg.method.video, text_length(b)  # type: ignore[attr-defined]
    return {
        "frames": torch.randint(
            0, 256, (size, video.num_frames, 3, video.image_size, video.image_size), dtype=torch.uint8
        ),
        "input_ids": torch.randint(1, 100, (size, length)),
        "attention_mask": torch.ones(size, length, dtype=torch.long),
    }


def dialogs(cfg: Config, size: int) -> dict[str, Any]:
    """One sub-batch per source (`per_source` splits the micro-batch evenly), every dialog at `max_len`."""
    from mmpt.losses.tree_score import VIEWS

    m: Any = cfg.method
    sources = [s.name or s.shards for s in cfg.data.train.sources]
    per_source = cfg.data.train.compose == "per_source"
    groups = {}
    for name in sources if per_source else ["batch"]:
        n = max(1, size // len(sources)) if per_source else size
        shape = (n, m.max_len)
        predicted = max(1, round(MLM_SHARE * n * m.max_len))
        groups[name] = {
            **{key: torch.ones(shape, dtype=torch.long) for key in ("input_ids", "positions", "turns", "roles")},
            "mlm_input_ids": torch.ones(shape, dtype=torch.long),
            "mlm_labels": torch.ones(shape, dtype=torch.long),
            "attention_mask": torch.ones(shape, dtype=torch.bool),
            "mlm_positions": torch.zeros(predicted, 2, dtype=torch.long),
            "label_views": torch.zeros(n, len(VIEWS), m.max_label_elements, dtype=torch.long),
            "label_frame": torch.zeros(n, dtype=torch.long),
        }
    return groups if per_source else groups["batch"]
