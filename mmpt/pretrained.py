"""Named models and pretrained tags, in the manner of open_clip's `list_models` / `list_pretrained`.

A model name is a minimal config (method section) built with mmpt's defaults; a tag says where its
weights come from. The official M²-Encoder checkpoints are published on ModelScope, not the
Hugging Face hub: their tag records the public id; the model loads from a local download (the `.ckpt`
and the GLM `sp.model` beside it) through the official-format converter, never by unpickling
(`torch.load(weights_only=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmpt.artifacts import HUB_PREFIX, has_weights, resolve

MODELS: dict[str, dict[str, Any]] = {
    name: {"name": "m2_encoder", "model": name} for name in ("m2-encoder-0.4b", "m2-encoder-1b", "m2-encoder-10b")
}

PRETRAINED: dict[str, dict[str, str]] = {  # model -> tag -> where the weights are published
    "m2-encoder-0.4b": {"official": "modelscope:M2Cognition/M2-Encoder"},
    "m2-encoder-1b": {"official": "modelscope:M2Cognition/M2_Encoder_Large"},
    "m2-encoder-10b": {"official": "modelscope:M2Cognition/M2_Encoder_Huge"},
}


def list_models() -> list[str]:
    return sorted(MODELS)


def list_pretrained(as_str: bool = False) -> list[tuple[str, str]] | list[str]:
    pairs = [(model, tag) for model in sorted(PRETRAINED) for tag in PRETRAINED[model]]
    return [f"{m}:{t}" for m, t in pairs] if as_str else pairs


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
    tokenizer = official_tokenizer(path)
    if tokenizer is None:
        raise FileNotFoundError(f"{path.parent}: the GLM tokenizer sp.model was not found beside the checkpoint")
    return path, tokenizer


def official_tokenizer(checkpoint: Path) -> Path | None:
    """The GLM `sp.model` of an official download: beside its checkpoint or one folder up."""
    found = sorted(checkpoint.parent.rglob("sp.model")) or sorted(checkpoint.parent.parent.rglob("sp.model"))
    return found[0] if found else None


@dataclass(frozen=True)
class InitialWeights:
    """What `method.init_from` names, resolved: an official checkpoint file, or an mmpt release or finished run."""

    kind: str  # "official-m2" or "mmpt"
    path: Path  # the .ckpt file, or the release / run directory
    tokenizer: Path | None  # the tokenizer file that came with the weights, if any


def initial_weights(spec: str) -> InitialWeights:
    """Resolve `method.init_from`: an official download folder or `.ckpt`, an mmpt release or finished run
    directory, or `hf-hub:<org>/<name>` (a release, through the hub cache). FileNotFoundError if none fits."""
    path = resolve(spec) if spec.startswith(HUB_PREFIX) else Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir() and has_weights(path):
        tokenizers = [path / name for name in ("sp.model", "tokenizer.json") if (path / name).is_file()]
        return InitialWeights("mmpt", path, tokenizers[0] if tokenizers else None)
    if path.is_file() and path.suffix != ".ckpt":
        raise FileNotFoundError(f"{path} is neither an official .ckpt nor a release or run directory")
    if path.is_dir():
        checkpoint = next(iter(sorted(path.rglob("*.ckpt"))), None)
        if checkpoint is None:
            raise FileNotFoundError(
                f"{path} holds no .ckpt (an official download) and no model.safetensors (a release or finished run)"
            )
        path = checkpoint
    return InitialWeights("official-m2", path, official_tokenizer(path))
