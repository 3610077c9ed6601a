"""`--format open_clip`: a model config and a state dict that open_clip loads as they are.

The folder holds `<name>.json` (the model config, registered with `open_clip.add_model_config`),
`open_clip_model.safetensors` (open_clip's parameter names), `open_clip_config.json` (the same model
config with its preprocessing, for `open_clip.create_model_and_transforms("local-dir:<folder>")`)
and what else the method's `open_clip_export` writes there (for a `clip` model, the text tower's
Hugging Face config and tokenizer). The method turns its model into open_clip's (`Method.open_clip_export`,
`Method.open_clip_preprocess`); this module writes, checks and describes the folder.

After writing, the folder is loaded with open_clip and its image and text features compared with mmpt's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmpt.export.card import EVAL_LINE, mmpt_usage, open_clip_lines, open_clip_name, open_clip_preprocess, write_card
from mmpt.export.formats import LoadedModel
from mmpt.export.towers import towers
from mmpt.methods import get_method
from mmpt.methods.base import OpenClipFolder

WEIGHTS = "open_clip_model.safetensors"
LOCAL_CONFIG = "open_clip_config.json"
TOLERANCE = 1e-5


def features(model: Any, images: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None):
    with torch.no_grad():
        text = model.encode_text(ids, mask) if mask is not None else model.encode_text(ids)
        return model.encode_image(images), text


def check_folder(model: LoadedModel, out: Path) -> float:
    """Load the folder with open_clip and compare its features with mmpt's; RuntimeError past TOLERANCE."""
    import open_clip

    loaded: Any = open_clip.create_model(f"local-dir:{out}").eval()
    image_tower, text_tower = towers(model.model, model.config)
    images = image_tower.example(2)[0]
    ids, *mask = text_tower.example(2)
    if mask:  # open_clip derives the mask from the padding id: put that id where mmpt's mask says padding
        pad_id = loaded.text.config.pad_token_id
        ids = ids.masked_fill(ids == pad_id, pad_id + 1).masked_fill(mask[0] == 0, pad_id)
    ours = features(model.model, images, ids, mask[0] if mask else None)
    with torch.no_grad():
        theirs = loaded.encode_image(images, normalize=True), loaded.encode_text(ids, normalize=True)
    error = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    if not error <= TOLERANCE:
        raise RuntimeError(f"{out}: open_clip's features differ from mmpt's by {error:.2e} (more than {TOLERANCE:g})")
    return error


def export_open_clip(model: LoadedModel, out: Path, check: bool = True) -> Path:
    """Write `model` (of a method with "open_clip" in its `export_formats`, checked by `formats.check_export`)
    as an open_clip folder."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    module = model.model.float().eval()
    folder = get_method(cfg.method_name).open_clip_export(module, cfg, model.files_from, out)
    save_file({k: v.detach().cpu().contiguous() for k, v in folder.state.items()}, str(out / WEIGHTS))
    name = open_clip_name(out)
    (out / f"{name}.json").write_text(json.dumps(folder.config, indent=2) + "\n")
    local = {"model_cfg": folder.config, "preprocess_cfg": open_clip_preprocess(cfg)}
    (out / LOCAL_CONFIG).write_text(json.dumps(local, indent=2) + "\n")
    if check:
        check_folder(model, out)
    write_open_clip_card(model, out, name, folder)
    return out


def write_open_clip_card(model: LoadedModel, out: Path, name: str, folder: OpenClipFolder) -> None:
    cfg = model.config
    where = str(out)
    usage = [
        "### With open_clip",
        "",
        "```python",
        *open_clip_lines(where, cfg),
        "```",
        "",
        "or, with the preprocessing read from `open_clip_config.json`:",
        "",
        "```python",
        "import open_clip",
        f'model, _, preprocess = open_clip.create_model_and_transforms("local-dir:{where}")',
        EVAL_LINE,
        f'tokenizer = open_clip.get_tokenizer("local-dir:{where}")',
        "```",
        "",
        "`model.encode_image(preprocess(image).unsqueeze(0))` and `model.encode_text(tokenizer(texts))` give "
        "mmpt's features (`normalize=True` for L2-normalised ones).",
    ]
    for note in folder.notes:
        usage += ["", note]
    usage += ["", "### With mmpt", "", mmpt_usage(cfg, str(model.files_from))]
    files = [
        (f"{name}.json", f"open_clip model config (`open_clip.add_model_config`, model name `{name}`)"),
        (WEIGHTS, "the state dict, open_clip's parameter names"),
        (LOCAL_CONFIG, "model config and preprocessing for `local-dir:`"),
        *folder.files,
    ]
    title = f"an mmpt `{cfg.method_name}` model for open_clip"
    write_card(
        out, cfg, model.files_from, model.model.state_dict(), title=title, kind="open_clip", usage=usage, files=files
    )
