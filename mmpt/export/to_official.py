"""`--format official`: a model in the checkpoint layout of its method's official code, so a model
continue-pretrained with mmpt goes back to that code (M²-Encoder's: `m2_encoder.ckpt`, Lightning layout).

The method writes the files (`Method.official_export`); this module makes the folder and its card.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmpt.config import Config
from mmpt.export.card import write_card
from mmpt.methods import get_method


def export_official(cfg: Config, state: dict[str, torch.Tensor], files_from: Path, out: Path) -> Path:
    """Write the official-layout checkpoint of a run or release (`state`: its weights) and what the official
    code reads beside it; returns the checkpoint's path."""
    out.mkdir(parents=True, exist_ok=True)
    folder = get_method(cfg.method_name).official_export(cfg, state, files_from, out)
    write_card(out, cfg, files_from, state, title=folder.title, kind="official", usage=folder.usage, files=folder.files)
    return out / folder.files[0][0]
