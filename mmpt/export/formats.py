"""The export formats, and which model each applies to: checked from the config alone, before any weight
is read, so a request that cannot work ends in one line (a ConfigError: exit 2 from the commands).

"release" and "onnx" apply to every model with towers; the others to the methods that list them in
`Method.export_formats`, whose `export_problem` may still refuse a config."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import nn

from mmpt.config import Config, ConfigError
from mmpt.methods import get_method

FORMATS = {
    "release": "an mmpt release: config.json, safetensors weights, tokenizer files, model card (the default)",
    "onnx": "one ONNX file per tower, preprocessing.json (the input contract) and the tokenizer files",
    "open_clip": "an open_clip model config and state dict that open_clip.create_model_and_transforms loads",
    "official": "the checkpoint layout the method's official code reads, with its tokenizer",
    "transformers": "a folder transformers.AutoModel.from_pretrained loads, with its tokenizer and image processor",
}
COMMON = ("release", "onnx")  # the formats every method's models go to (onnx: those with towers)


class LoadedModel(Protocol):
    """A built model with its weights, the config it was built from and the run or release folder it came
    from (`mmpt.release.PretrainedModel`, or one `launch/export.py` builds from a checkpoint)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def config(self) -> Config: ...

    @property
    def files_from(self) -> Path: ...

    def preprocessors(self) -> dict[str, Any]: ...


def _alternatives(cfg: Config, fmt: str) -> str:
    others = [other for other in supported_formats(cfg) if other != fmt]
    return " or ".join(others) if len(others) < 3 else f"{', '.join(others[:-1])} or {others[-1]}"


def format_problem(cfg: Config, fmt: str) -> str | None:
    """Why `cfg`'s model cannot be exported as `fmt` (None: it can)."""
    name = cfg.method_name
    method = get_method(name)
    if fmt not in FORMATS:
        return f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}"
    if fmt == "onnx" and not method.tower_names:
        return f"the '{name}' model has no towers mmpt can export to ONNX"
    if fmt in COMMON:
        return None
    if fmt not in method.export_formats:
        if fmt == "open_clip":
            return f"open_clip cannot build a '{name}' model (use --format {_alternatives(cfg, fmt)})"
        return (
            f"--format {fmt} writes {FORMATS[fmt]}; a '{name}' model has none (use --format {_alternatives(cfg, fmt)})"
        )
    return method.export_problem(cfg, fmt)


def supported_formats(cfg: Config) -> list[str]:
    return [
        fmt
        for fmt in FORMATS
        if (fmt in COMMON or fmt in get_method(cfg.method_name).export_formats) and format_problem(cfg, fmt) is None
    ]


def check_export(cfg: Config, fmt: str, towers: str | None = None) -> list[str]:
    """The towers to export (empty for formats without towers); ConfigError when the request cannot work."""
    problem = format_problem(cfg, fmt)
    if problem is not None:
        raise ConfigError(problem)
    if fmt != "onnx":
        if towers is not None:
            raise ConfigError(f"--towers applies to --format onnx, not to --format {fmt}")
        return []
    own = get_method(cfg.method_name).tower_names
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
