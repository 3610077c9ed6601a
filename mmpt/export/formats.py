"""The export formats, and which model each applies to: checked from the config alone, before any weight
is read, so a request that cannot work ends in one line (a ConfigError: exit 2 from the commands)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from mmpt.config import Config, ConfigError
from mmpt.export.towers import TOWER_NAMES

if TYPE_CHECKING:
    from mmpt.methods.clip import ClipConfig

FORMATS = {
    "release": "an mmpt release: config.json, safetensors weights, tokenizer files, model card (the default)",
    "onnx": "one ONNX file per tower, preprocessing.json (the input contract) and the tokenizer files",
    "open_clip": "an open_clip model config and state dict that open_clip.create_model_and_transforms loads",
    "official": "the official M2-Encoder checkpoint layout (.ckpt) with its tokenizer",
}
# A `clip` image tower's timm arguments that open_clip's timm adapter sets itself (as `vision_cfg` keys); they
# are training-time regularisers and change no weight. Any other argument (img_size, depth, patch_size, ...)
# builds a network open_clip cannot build, since its adapter passes no other timm.create_model arguments.
OPEN_CLIP_TIMM_KWARGS = {"drop_path_rate": "timm_drop_path"}


def open_clip_problem(cfg: Config) -> str | None:
    """Why open_clip cannot build this model (None: it can)."""
    method = cfg.method_name
    if method == "open_clip":
        return None  # an open_clip model already
    if method == "clip":
        # open_clip builds a timm image tower (TimmModel) and a Hugging Face text tower (HFTextEncoder, mean
        # pooling, linear projection): the `clip` model exactly, when timm gets no argument open_clip cannot pass.
        extra = sorted(set(cast("ClipConfig", cfg.method).image.timm_kwargs) - set(OPEN_CLIP_TIMM_KWARGS))
        if extra:
            return (
                f"open_clip cannot build this clip image tower: config key 'method.image.timm_kwargs' sets "
                f"{', '.join(extra)}, and open_clip's timm adapter passes no such timm.create_model argument "
                "(use --format onnx or release)"
            )
        return None
    return (
        f"open_clip cannot build a '{method}' model: --format open_clip applies to the clip and open_clip "
        f"methods (use --format {'onnx or official' if method == 'm2_encoder' else 'onnx or release'})"
    )


def format_problem(cfg: Config, fmt: str) -> str | None:
    """Why `cfg`'s model cannot be exported as `fmt` (None: it can)."""
    method = cfg.method_name
    if fmt not in FORMATS:
        return f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}"
    if fmt == "onnx" and method not in TOWER_NAMES:
        return f"the '{method}' model has no towers mmpt can export to ONNX"
    if fmt == "open_clip":
        return open_clip_problem(cfg)
    if fmt == "official" and method != "m2_encoder":
        return (
            f"--format official writes the official M2-Encoder checkpoint layout; a '{method}' model has none "
            "(use --format release or onnx)"
        )
    return None


def supported_formats(cfg: Config) -> list[str]:
    return [fmt for fmt in FORMATS if format_problem(cfg, fmt) is None]


def check_export(cfg: Config, fmt: str, towers: str | None = None) -> list[str]:
    """The towers to export (empty for formats without towers); ConfigError when the request cannot work."""
    problem = format_problem(cfg, fmt)
    if problem is not None:
        raise ConfigError(problem)
    if fmt != "onnx":
        if towers is not None:
            raise ConfigError(f"--towers applies to --format onnx, not to --format {fmt}")
        return []
    own = TOWER_NAMES[cfg.method_name]
    if towers is None:
        return list(own)
    names = [name.strip() for name in towers.split(",") if name.strip()]
    unknown = [name for name in names if name not in own]
    if unknown or not names:
        raise ConfigError(
            f"--towers {towers!r}: the '{cfg.method_name}' model has no "
            f"{' or '.join(repr(n) for n in unknown) or 'named'} tower; its towers: {', '.join(own)}"
        )
    return [name for name in own if name in names]
