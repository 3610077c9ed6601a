"""`--format official`: a model in the checkpoint layout of its method's official code, so a model
continue-pretrained with mmpt goes back to that code (M²-Encoder's: `m2_encoder.ckpt`, Lightning layout).

The method writes the files (`Method.official_export`); this module makes the folder and its card.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmpt.config import Config
from mmpt.export.card import CARD, parameter_counts, render, training_record
from mmpt.methods import get_method


def export_official(cfg: Config, state: dict[str, torch.Tensor], files_from: Path, out: Path) -> Path:
    """Write the official-layout checkpoint of a run or release (`state`: its weights) and what the official
    code reads beside it; returns the checkpoint's path."""
    out.mkdir(parents=True, exist_ok=True)
    folder = get_method(cfg.method_name).official_export(cfg, state, files_from, out)
    card = render(
        cfg,
        title=f"{out.resolve().name}: {folder.title}",
        kind="official",
        parameters=parameter_counts(cfg, files_from, state),
        record=training_record(files_from),
        usage="\n".join(["## How to use it", "", *folder.usage]),
        files=[*folder.files, (CARD, "this card")],
        files_from=files_from,
    )
    (out / CARD).write_text(card, encoding="utf-8")
    return out / folder.files[0][0]
