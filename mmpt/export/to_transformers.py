"""`launch/export.py --format transformers`: a folder `transformers.AutoModel.from_pretrained` loads (config,
safetensors weights, tokenizer, image processor), for models of the `transformers` method and open_clip's plain ViT
CLIPs, checked by loading it back and comparing its embeddings with mmpt's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mmpt.export.card import CARD, transformers_lines, write_card
from mmpt.export.formats import LoadedModel
from mmpt.methods import get_method

TOLERANCE = 1e-5  # largest |transformers - mmpt| of the fp32 features on the check


def export_transformers(model: LoadedModel, out: Path, check: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    module = model.model.float().eval()
    get_method(model.config.method_name).transformers_export(module, model.config, model.files_from, out)
    if check:
        check_folder(module, out)
    written = sorted(p for p in out.iterdir() if p.name != CARD)  # the card lists what transformers wrote
    files = [(p.name, WRITTEN.get(p.suffix, "written by transformers' save_pretrained")) for p in written]
    usage, state = transformers_lines(str(out), model.config), model.model.state_dict()
    write_card(
        out,
        model.config,
        model.files_from,
        state,
        title="a transformers model",
        kind="transformers",
        usage=usage,
        files=files,
    )
    return out


WRITTEN = {  # what each kind of file transformers' save_pretrained writes holds
    ".safetensors": "the weights",
    ".py": "the model's own code (`trust_remote_code=True`)",
    ".model": "the tokenizer's vocabulary",
}


def check_folder(module: Any, out: Path) -> None:
    """The folder, loaded by transformers, gives mmpt's image and text features (random pixels, the tokenizer's
    ids of a caption). A folder carrying its own modelling code (`auto_map`) is mmpt's, written just now."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    remote = "auto_map" in json.loads((out / "config.json").read_text())
    loaded = AutoModel.from_pretrained(out, trust_remote_code=remote).eval()
    config = AutoConfig.from_pretrained(out, trust_remote_code=remote)
    vision = getattr(config, "vision_config", config)
    length = int(
        getattr(module, "context_length", 0)
        or getattr(config, "context_length", 0)
        or config.text_config.max_position_embeddings
    )
    tokens = AutoTokenizer.from_pretrained(out, trust_remote_code=remote)(
        ["a photo of a cat", "一只猫的照片"],
        padding="max_length",
        truncation=True,
        max_length=length,
        return_tensors="pt",
    )
    size = int(getattr(vision, "image_size", 0))
    with torch.no_grad():
        ours = module.encode_text(tokens["input_ids"], tokens["attention_mask"])
        mask = tokens["attention_mask"] if remote or getattr(module, "reads_mask", False) else None
        theirs = _features(loaded.get_text_features(input_ids=tokens["input_ids"], attention_mask=mask))
        gaps = [(ours - F.normalize(theirs, dim=-1)).abs().max().item()]
        if size:  # SigLIP 2 reads patches: its text check suffices for the weights' layout
            pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
            image = _features(loaded.get_image_features(pixel_values=pixels))
            gaps.append((module.encode_image(pixels) - F.normalize(image, dim=-1)).abs().max().item())
    if max(gaps) > TOLERANCE:
        raise RuntimeError(f"{out}: transformers' features differ from mmpt's by {max(gaps):.2e} (> {TOLERANCE})")


def _features(output: Any) -> torch.Tensor:
    """A model's features: transformers' own classes return them as `pooler_output`, mmpt's folders as a tensor."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output
