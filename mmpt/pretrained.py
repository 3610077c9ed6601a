"""Named models and pretrained tags, in the manner of open_clip's `list_models` / `list_pretrained`.

A model name is a minimal config (method section) built with mmpt's defaults; a tag says where its
weights come from. The official M²-Encoder checkpoints are published on ModelScope, not the
Hugging Face hub: their tag records the public id and the preprocessing they expect, and loads
from a local download (the `.ckpt` and the GLM `sp.model` beside it) through the official-format
converter, never by unpickling (`torch.load(weights_only=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

M2_PREPROCESS = {
    "image_size": 224, "resize": "squash to a square, bicubic", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
    "tokenizer": "GLM SentencePiece (sp.model), [CLS] ... <|endoftext|>, 52 ids, left truncation, pad 50000",
}


@dataclass(frozen=True)
class PretrainedTag:
    source: str  # where the weights are published
    format: str  # "official-m2" (a .ckpt to convert) or "mmpt-release"
    preprocess: dict[str, Any] = field(default_factory=dict)
    notes: str = ""


MODELS: dict[str, dict[str, Any]] = {
    name: {"name": "m2_encoder", "model": name} for name in ("m2-encoder-0.4b", "m2-encoder-1b", "m2-encoder-10b")
}

PRETRAINED: dict[str, dict[str, PretrainedTag]] = {
    "m2-encoder-0.4b": {"official": PretrainedTag("modelscope:M2Cognition/M2-Encoder", "official-m2", M2_PREPROCESS)},
    "m2-encoder-1b": {"official": PretrainedTag("modelscope:M2Cognition/M2_Encoder_Large", "official-m2",
                                                M2_PREPROCESS)},
    "m2-encoder-10b": {"official": PretrainedTag("modelscope:M2Cognition/M2_Encoder_Huge", "official-m2",
                                                 M2_PREPROCESS)},
}


def list_models() -> list[str]:
    return sorted(MODELS)


def list_pretrained(as_str: bool = False) -> list[tuple[str, str]] | list[str]:
    pairs = [(model, tag) for model in sorted(PRETRAINED) for tag in PRETRAINED[model]]
    return [f"{m}:{t}" for m, t in pairs] if as_str else pairs


def pretrained_tag(model: str, tag: str) -> PretrainedTag:
    if model not in PRETRAINED or tag not in PRETRAINED[model]:
        known = ", ".join(f"{m}:{t}" for m, t in list_pretrained())
        raise ValueError(f"no pretrained tag {tag!r} for {model!r}; known: {known}")
    return PRETRAINED[model][tag]


def official_m2_files(path: str | Path) -> tuple[Path, Path]:
    """(checkpoint, sp.model) of a local download of an official M²-Encoder: a .ckpt file or its folder."""
    path = Path(path)
    if path.is_dir():
        checkpoints = sorted(path.rglob("*.ckpt"))
        if not checkpoints:
            raise FileNotFoundError(f"{path}: no .ckpt found in this official M2-Encoder download")
        path = checkpoints[0]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not an official M2-Encoder checkpoint file or folder")
    tokenizers = sorted(path.parent.rglob("sp.model")) or sorted(path.parent.parent.rglob("sp.model"))
    if not tokenizers:
        raise FileNotFoundError(f"{path.parent}: the GLM tokenizer sp.model was not found beside the checkpoint")
    return path, tokenizers[0]
