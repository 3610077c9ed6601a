"""mmpt: multimodal contrastive pretraining on one DeepSpeed + WebDataset spine.

Using a released model:

    import mmpt
    model = mmpt.load("runs/clip-demo")            # a release or run directory, or "hf-hub:org/name"
    tokenizer, preprocess = model.preprocessors()["tokenizer"], model.preprocessors()["preprocess"]
    model, preprocess_train, preprocess_val = mmpt.create_model_and_transforms("m2-encoder-0.4b", pretrained=path)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmpt.config import Config, ConfigError

if TYPE_CHECKING:
    from mmpt.config_loader import load_config
    from mmpt.methods import list_methods
    from mmpt.pretrained import list_models, list_pretrained

__version__ = "0.1.0"

# Imported when first used: `import mmpt` (and every command's start, and each worker process a command spawns)
# then does not pay for torch and the methods before it needs them.
_LAZY = {
    "load_config": "mmpt.config_loader",
    "list_methods": "mmpt.methods",
    "list_models": "mmpt.pretrained",
    "list_pretrained": "mmpt.pretrained",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mmpt' has no attribute {name!r}")


def load(name_or_path: str | os.PathLike, device: str = "cpu"):
    """A ready model (eval mode) from a release directory, a finished run, or `hf-hub:<org>/<name>`.

    The result has the model's own `encode_*` methods, `preprocessors()` (tokenizer and transforms)
    and `save_pretrained(dir)`.
    """
    from mmpt.artifacts import resolve
    from mmpt.release import load_directory

    return load_directory(resolve(name_or_path), device)


def create_model_and_transforms(model_name: str, pretrained: str | os.PathLike | None = None, device: str = "cpu"):
    """(model, preprocess_train, preprocess_val), as open_clip returns them.

    `model_name` is a release/run directory or hub id (`pretrained` unused), or a name from
    `list_models()` with `pretrained` the local download of an official checkpoint (see
    `list_pretrained()` for where each is published).
    """
    model = _load_named(model_name, pretrained, device)
    pre = model.preprocessors()
    return model, pre.get("preprocess_train"), pre.get("preprocess")


def get_tokenizer(model_name: str, pretrained: str | os.PathLike | None = None) -> Any:
    """The tokenizer of a release/run directory, hub id, or named model with its official download."""
    from mmpt.pretrained import list_models

    if model_name in list_models():
        from mmpt.models.m2_remote.glm_tokenizer import GLMTokenizer
        from mmpt.pretrained import official_m2_files

        if pretrained is None:
            raise ValueError(f"{model_name}: pass pretrained=<local download> (its sp.model is the tokenizer)")
        return GLMTokenizer(official_m2_files(Path(pretrained))[1], 52)
    return load(model_name).preprocessors()["tokenizer"]


def _load_named(model_name: str, pretrained, device: str):
    from mmpt.pretrained import list_models

    if model_name not in list_models():
        return load(model_name, device)
    from mmpt.methods import get_method
    from mmpt.pretrained import MODELS, PRETRAINED, official_m2_files
    from mmpt.release import PretrainedModel, model_config

    if pretrained is None or str(pretrained) in PRETRAINED.get(model_name, {}):
        source = PRETRAINED[model_name]["official"]
        raise ValueError(
            f"{model_name}: download the official weights ({source}) and pass their local folder "
            "or .ckpt as pretrained="
        )
    checkpoint, sp_model = official_m2_files(pretrained)
    cfg = model_config({**MODELS[model_name], "tokenizer": str(sp_model), "init_from": str(checkpoint)})
    method = get_method(cfg.method_name)
    files = Path(sp_model).parent  # what build_model reads (sp.model) lies beside the checkpoint
    model = method.build_model(cfg, files)
    method.load_initial_weights(model, cfg)
    return PretrainedModel(model, cfg, files).to(device).eval()


__all__ = [
    "Config",
    "ConfigError",
    "create_model_and_transforms",
    "get_tokenizer",
    "list_methods",
    "list_models",
    "list_pretrained",
    "load",
    "load_config",
    "__version__",
]
